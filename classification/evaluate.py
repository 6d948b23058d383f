"""Accuracy, macro-F1 and loss over a whole split, sharded over the data-parallel ranks.

    python -m pytest -q tests/test_classification_train.py -k eval

Each rank runs its eval_batches (the same count everywhere: under ZeRO-3 every forward gathers
parameters collectively, so a rank with one row fewer pads with a zero-weight row), then one
all-reduce sums the confusion matrix and the loss.
Cost: one forward per row; one all-reduce of (num_labels² + 1) float64 per split.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from classification.batches import collate, eval_batches


@torch.no_grad()
def evaluate(model, ids, labels, num_labels, pad_id, rank, world, batch=64, forward=None, group=None):
    """accuracy, macro-F1 and mean loss over the whole split (sharded over ranks, then summed).
    forward: the engine's forward (defaults to model's). With --tp, rank/world/group are the
    data-parallel ones (the tp ranks of a replica compute the same rows together)."""
    was = model.training
    model.eval()
    forward = forward or model
    conf = torch.zeros(num_labels, num_labels, dtype=torch.float64)  # rows: true, cols: predicted
    loss_sum = torch.zeros(1, dtype=torch.float64)
    for idx, keep in eval_batches(len(ids), np.argsort([len(t) for t in ids], kind="stable"), rank, world, batch):
        b = collate(ids, labels, idx, pad_id)
        out = forward(**b)
        if not keep:
            continue
        loss_sum += out.loss.double() * len(b["labels"])
        pred = out.logits.argmax(-1)
        conf.index_put_((b["labels"], pred), torch.ones(len(pred), dtype=torch.float64), accumulate=True)
    if world > 1:
        t = torch.cat([conf.flatten(), loss_sum])
        dist.all_reduce(t, group=group)
        conf, loss_sum = t[:-1].view(num_labels, num_labels), t[-1:]
    model.train(was)
    n = conf.sum().item()
    tp = conf.diag()
    f1 = (2 * tp / (conf.sum(0) + conf.sum(1)).clamp(min=1)).mean().item()
    return {"accuracy": tp.sum().item() / n, "macro_f1": f1, "loss": loss_sum.item() / n, "n": int(n)}
