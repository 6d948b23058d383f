"""The tokenized rows of a classification split, padded to one length (what train.py and
loop3d.py both feed their models).

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2
"""
from __future__ import annotations

import torch


def tokenized(tok, split, max_len: int):
    """(input_ids, attention_mask, labels) of every row of `split`, padded to max_len tokens."""
    enc = tok(list(split.texts), padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], torch.tensor(split.labels, dtype=torch.long)
