"""Cross-entropy over vocab-parallel logits, never materialising the full logits
(Megatron-LM's `vocab_parallel_cross_entropy`).

    python -m pytest -q tests/test_tensor_parallel.py -k cross_entropy

Rank r holds logits z[:, V_r] for its vocabulary slice V_r. For target t:

    loss = log Σ_v exp(z_v) − z_t = log Σ_v exp(z_v − m) − (z_t − m),   m = max_v z_v

    1. m      = all-reduce MAX of the local maxima            (b·s elements)
    2. z_t − m: the owner of t contributes it, others 0; all-reduce SUM   (b·s)
    3. Σ exp  = all-reduce SUM of the local sums              (b·s)

Backward: ∂loss/∂z_v = softmax(z)_v − [v = t], computed locally from the saved local softmax
slice; no communication. So the cost is 3 all-reduces of b·s elements instead of gathering
b·s·V logits (V = 30,522 for DistilBERT's vocabulary). m is a constant under autograd (it
cancels), which is why MAX needs no gradient.
"""
from __future__ import annotations

import torch

from tensor_parallel.comm import ALGORITHM
from tensor_parallel.layers import shard_bounds


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from this rank's logit slice: 3 all-reduces of b·s elements forward, none backward."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, comm):
        lo, hi = shard_bounds(vocab_size, comm.size, comm.rank)
        if logits.shape[-1] != hi - lo:
            raise ValueError(f"rank {comm.rank}: vocab_parallel_cross_entropy: logits hold {logits.shape[-1]} "
                             f"vocabulary entries, expected {hi - lo} (ids [{lo}, {hi}) of {vocab_size})")
        z = logits.float()
        m = z.max(dim=-1).values
        comm.all_reduce(m, "max", algorithm=ALGORITHM["all_reduce"])
        z = z - m.unsqueeze(-1)
        mine = (target >= lo) & (target < hi)
        local_t = (target - lo).masked_fill(~mine, 0)
        zt = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        comm.all_reduce(zt, "sum", algorithm=ALGORITHM["all_reduce"])
        e = z.exp()
        total = e.sum(dim=-1)
        comm.all_reduce(total, "sum", algorithm=ALGORITHM["all_reduce"])
        ctx.save_for_backward(e.div_(total.unsqueeze(-1)), local_t, mine)
        ctx.dtype = logits.dtype
        return total.log() - zt

    @staticmethod
    def backward(ctx, dloss):
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax.clone()
        rows = g.view(-1, g.shape[-1])
        idx = torch.arange(rows.shape[0])
        rows[idx, local_t.reshape(-1)] -= mine.reshape(-1).to(g.dtype)
        return (g * dloss.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits, target, vocab_size: int, comm, reduction: str = "mean"):
    """Per-token loss (reduction="none"), or its mean / sum, for logits split by vocabulary over
    `comm`'s ranks like VocabParallelEmbedding (shard_bounds over `vocab_size`)."""
    loss = VocabParallelCrossEntropy.apply(logits, target, vocab_size, comm)
    if reduction == "none":
        return loss
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return loss.mean() if reduction == "mean" else loss.sum()
