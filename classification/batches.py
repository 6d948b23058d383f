"""The order classification/train.py reads its rows in: tokenised ids, padded batches, per-rank epochs.

    python -m pytest -q tests/test_classification.py -k epoch_batches

Per epoch a permutation seeded by (--seed, epoch), cut into global batches (micro x accumulation x
world) whose texts have similar lengths (sorted within chunks of 50 global batches, then the batches
are shuffled), and rank r takes every world-th text of each one, so ranks see equal lengths and do
equal numbers of steps (an unequal count would hang the collective). Evaluation deals the split
round-robin in length order, the same number of batches on every rank (eval_batches).
Cost: tokenisation once, O(rows); no communication.
"""
from __future__ import annotations

import numpy as np
import torch


def tokenize(tok, texts, max_len):
    return tok(list(texts), truncation=True, max_length=max_len)["input_ids"]


def collate(ids, labels, idx, pad_id):
    L = max(len(ids[i]) for i in idx)
    x = torch.full((len(idx), L), pad_id, dtype=torch.long)
    m = torch.zeros((len(idx), L), dtype=torch.long)
    for r, i in enumerate(idx):
        x[r, :len(ids[i])] = torch.tensor(ids[i])
        m[r, :len(ids[i])] = 1
    return {"input_ids": x, "attention_mask": m, "labels": torch.tensor([labels[i] for i in idx])}


def epoch_batches(lengths, micro, gas, world, rank, seed, epoch, chunk=50):
    """This rank's micro-batches (lists of row indices) for one epoch; drops the last partial batch."""
    g = micro * gas * world
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))[: len(lengths) // g * g]
    lengths = np.asarray(lengths)
    for s in range(0, len(perm), g * chunk):  # similar lengths inside a global batch: less padding
        c = perm[s:s + g * chunk]
        perm[s:s + g * chunk] = c[np.argsort(lengths[c], kind="stable")]
    gb = perm.reshape(-1, g)[rng.permutation(len(perm) // g)]
    out = []
    for b in gb:
        mine = b[rank::world]
        out += [mine[k * micro:(k + 1) * micro].tolist() for k in range(gas)]
    return out


def eval_batches(n, lengths_order, rank, world, batch):
    """This rank's evaluation batches: (row indices, how many of them count). Rows are dealt
    round-robin in length order; every rank gets ceil(ceil(n / world) / batch) batches, the same
    number everywhere, and a rank left without rows for the last one re-reads row 0 with weight 0."""
    mine = lengths_order[rank::world].tolist()
    per_rank = -(-n // world)
    out = []
    for s in range(0, per_rank, batch):
        idx = mine[s:s + batch]
        out.append((idx, len(idx)) if idx else ([int(lengths_order[0])], 0))
    return out
