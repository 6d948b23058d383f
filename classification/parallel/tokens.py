"""The rows of a classification split as model inputs, padded to one length (what train.py and
loop3d.py both feed their models), tokenized when a batch asks for them.

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2

Cost: the tokenizer runs on the rows a run reads, not on the whole split (all 10,202 training rows
cost each rank ~2.5 CPU s here, more than a short run's steps). Padding to max_len makes a row's
tokens independent of the batch it comes in, so this gives the tensors one call over the split would.
"""
from __future__ import annotations

import torch


class Tokenized:
    """rows[idx] -> (input_ids, attention_mask, labels) of the split's rows idx, max_len tokens each."""

    def __init__(self, tok, split, max_len: int):
        self.tok, self.texts, self.max_len = tok, list(split.texts), max_len
        self.labels = torch.tensor(split.labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx).reshape(-1)
        if not len(idx):        # a rank with no rows of a small split (the tokenizer refuses an empty batch)
            none = torch.zeros(0, self.max_len, dtype=torch.long)
            return none, none.clone(), self.labels[idx]
        enc = self.tok([self.texts[i] for i in idx.tolist()], padding="max_length", truncation=True,
                       max_length=self.max_len, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], self.labels[idx]
