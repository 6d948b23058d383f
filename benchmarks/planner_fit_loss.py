"""The planner's vp_loss_s, a part of benchmarks.planner_fit: what tensor parallelism's
vocab-parallel cross-entropy costs a core beyond torch's fused loss, per logit element.

    python -m benchmarks.planner_fit --loss          # only vp_loss_s, into this processor's cpu_here.json (~10 s)

tensor_parallel.cross_entropy over a one-rank group (its all-reduces the identity) against
torch.nn.functional.cross_entropy on the same T × V logits, forward + backward, at the fit's
head shapes (HEADS), CPU time of one thread, the median of `reps`.
Cost: 4 × reps loss steps of up to 1 M logits per rank.
"""
from __future__ import annotations

import statistics
import time

import torch

from tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

HEADS = ((256, 128, 2048), (256, 64, 4096))      # tokens, h, V: the fit's heads (logit_s) and losses


def cpu(op, reps: int) -> float:
    """Median CPU seconds of op() after one warm-up call (every rate of benchmarks.planner_fit)."""
    op()
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        op()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


class OneRank:
    """A tensor-parallel group of one rank: its all-reduces are the identity."""
    size, rank = 1, 0

    def all_reduce(self, t, op="sum", algorithm=None):
        return t


def loss_cpu(T: int, V: int, reps: int, vocab_parallel: bool) -> float:
    """CPU seconds of the loss alone, forward + backward, over T × V logits of std 0.25 (Hugging
    Face's init, std 0.02, over h = 128 normalized inputs: no exp input near float32's underflow)."""
    z, tgt = (0.25 * torch.randn(T, V)).requires_grad_(), torch.randint(0, V, (T,))
    if vocab_parallel:
        return cpu(lambda: vocab_parallel_cross_entropy(z, tgt, V, OneRank()).backward(), reps)
    return cpu(lambda: torch.nn.functional.cross_entropy(z, tgt).backward(), reps)


def loss_sweep(rank: int, world: int, reps: int) -> dict:
    torch.set_num_threads(1)
    return {"losses": [loss_cpu(T, V, reps, False) for T, _, V in HEADS],
            "vp_losses": [loss_cpu(T, V, reps, True) for T, _, V in HEADS]}


def vp_loss_fit(got: list[dict]) -> float:
    """vp_loss_s from the ranks' loss timings: the vocab-parallel loss's CPU seconds beyond torch's, per logit element."""
    med = lambda key: [statistics.median(g[key][i] for g in got) for i in range(len(HEADS))]  # noqa: E731
    return statistics.mean(max(0.0, vp - t) / (T * V) for (T, _, V), t, vp in zip(HEADS, med("losses"), med("vp_losses")))


