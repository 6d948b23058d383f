"""Why the output layer's initialisation changes a CPU step's time: exp in float32 costs ~1 ns per
element until its input falls below ln(FLT_MIN) ≈ −87.3, where the result underflows and the
vectorised exp takes its slow path (~10 ns), for the whole vector of LANES floats if one lane needs
it, and returns subnormal numbers. The loss's exp(z − max z) sees such inputs only when the logits
spread by more than ~87, which a head initialised as torch's nn.Embedding (N(0, 1)) gives on
LayerNorm'd inputs and Hugging Face's std 0.02 does not. Inside the ranks the whole loss forward
slows by more than exp alone does here (python -m benchmarks.planner_phases --head-std 1).

    python -m benchmarks.planner_logits              # the sweep, then the 3D rows' head both ways

Rows: exp's CPU ns per element over inputs drawn uniformly from [lo, 0]; then the vocab-parallel
loss's inputs for the head of benchmarks.planner_local's 3D DistilBERT rows (one rank's 4,096 of
8,192 words, h 256, 2 × 128 tokens, LayerNorm'd hidden states): their spread, the fraction below
ln(FLT_MIN), of vectors holding one, exp's time on them, the subnormal share of its results and
the time of the loss's next two steps on them (row sums, divide). CPU seconds (thread_time), the median of REPEATS.
Cost: a few seconds, one process.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from rich.table import Table
from transformers import DistilBertConfig

from benchmarks.planner_ranks_tp import head_table
from primitives.log import console

UNDERFLOW = math.log(torch.finfo(torch.float32).tiny)       # ≈ −87.34: exp below it is subnormal or 0
TINY = torch.finfo(torch.float32).tiny
REPEATS = 15
LANES = 16                                                   # floats per AVX-512 vector


def ns_per_element(fn, z: torch.Tensor) -> float:
    """Median CPU ns per element of fn(z)."""
    fn(z)
    times = []
    for _ in range(REPEATS):
        t0 = time.thread_time()
        fn(z)
        times.append(time.thread_time() - t0)
    return statistics.median(times) / z.numel() * 1e9


def exp_ns(z: torch.Tensor) -> float:
    return ns_per_element(torch.exp, z)


def normalise(e: torch.Tensor) -> torch.Tensor:
    """The loss's next steps on exp's output: the row sums, then the softmax (e / sum)."""
    return e / e.sum(dim=-1, keepdim=True)


def loss_inputs(std: float | None, tokens: int = 256, dim: int = 256, vocab: int = 8192, tp: int = 2) -> torch.Tensor:
    """z − max z of one rank's logit slice: LayerNorm'd hidden states times head_table's slice."""
    cfg = DistilBertConfig(vocab_size=vocab, dim=dim)
    torch.manual_seed(0)
    w = head_table(cfg, std).weight.detach()[: vocab // tp]
    x = torch.nn.functional.layer_norm(torch.randn(tokens, dim), (dim,))
    z = x @ w.t()
    return z - z.max(dim=-1, keepdim=True).values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    torch.set_num_threads(1)
    sweep = Table(title="exp in float32: CPU ns per element, inputs uniform in [lo, 0]")
    sweep.add_column("lo", justify="right")
    sweep.add_column("ns / element", justify="right")
    for lo in (-10, -80, -87, -95, -120, -200):
        sweep.add_row(str(lo), f"{exp_ns(torch.empty(1 << 20).uniform_(lo, 0)):.2f}")
    console.print(sweep)
    head = Table(title=f"the 3D rows' loss inputs z − max z (below ln(FLT_MIN) = {UNDERFLOW:.1f}: the slow path)")
    for c in ("head table", "z std", "z min", "below", f"vectors of {LANES} with one", "exp ns / element",
              "subnormal results", "sum, divide ns / element"):
        head.add_column(c, justify="right")
    for std, name in ((1.0, "N(0, 1): torch's nn.Embedding"), (None, "std 0.02: Hugging Face's init")):
        z = loss_inputs(std)
        e = z.exp()
        head.add_row(name, f"{z.std():.1f}", f"{z.min():.0f}", f"{(z < UNDERFLOW).float().mean():.0%}",
                     f"{(z < UNDERFLOW).view(-1, LANES).any(dim=1).float().mean():.0%}", f"{exp_ns(z):.2f}",
                     f"{((e > 0) & (e < TINY)).float().mean():.1%}", f"{ns_per_element(normalise, e):.2f}")
    console.print(head)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
