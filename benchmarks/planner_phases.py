"""Where a step of benchmarks.planner_local's tensor-parallel rows spends its CPU seconds, per rank:
the pipeline's instructions, the DistilBERT modules (embedding, blocks, head, the vocab-parallel
loss and the exp inside it), the communicator's calls and their waits.

    python -m benchmarks.planner_phases                  # pp2·tp2 (4 ranks on the cores)
    python -m benchmarks.planner_phases --dp 2           # dp2·pp2·tp2 (8 ranks)
    python -m benchmarks.planner_phases --tp-only        # tp2: the same blocks without the pipeline
    python -m benchmarks.planner_phases --head-std 1     # the 3D head's table at torch's N(0, 1)

Each rank runs planner_local's rank function (benchmarks/planner_ranks_tp.py) with the methods
wrapped to add up their CPU seconds (thread_time) and wall seconds per step: the pipeline
executor's instructions (fwd, bwd, recv_*, send_*, step), the modules' forwards, the loss and its
exp(z − max z) (Tensor.exp wrapped), every call of the shared-memory communicator (outermost only) and its waits
(ShmComm.spin_until, yields counted). Printed: the median step after the first, ms. The wrapping
adds a few µs per call. Cost: one row's steps, 2-8 ranks.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from rich.table import Table

import benchmarks.planner_ranks_tp as T
import primitives.engine.shm as shm
from benchmarks import planner_ranks as PR
from benchmarks.planner_logits import UNDERFLOW
from pipeline_parallel.engine.draining import DrainingExecutor
from primitives.launch import spawn
from primitives.log import console

ACC: dict = {}
CALLS = ("all_reduce", "all_gather", "reduce_scatter", "isend", "irecv", "exchange")


def _add(key: str, cpu: float, wall: float = 0.0) -> None:
    c, w = ACC.get(key, (0.0, 0.0))
    ACC[key] = (c + cpu, w + wall)


def _wrap(owner, name: str, key, depth: list | None = None) -> None:
    """owner.name adds its CPU and wall seconds to ACC[key(args)] (outermost call only with depth)."""
    f = getattr(owner, name)

    def timed(*a, **k):
        if depth is not None and depth[0]:
            return f(*a, **k)
        if depth is not None:
            depth[0] += 1
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _add(key(a) if callable(key) else key, time.thread_time() - c0, time.perf_counter() - t0)
            if depth is not None:
                depth[0] -= 1
    setattr(owner, name, timed)


def _instrument() -> None:
    _wrap(DrainingExecutor, "do", lambda a: "pipeline " + a[1].kind)
    for cls, name in ((T._DistilEmbed, "embedding"), (T._DistilBlock, "blocks"), (T._DistilHead, "head")):
        _wrap(cls, "forward", f"module {name} (forward)")
    _wrap(T, "vocab_parallel_cross_entropy", "module loss (forward)")
    _wrap(torch.Tensor, "exp", "loss: Tensor.exp (z − max z)")       # the only exp of a DistilBERT step
    exp = torch.Tensor.exp

    def counted_exp(z):
        out = exp(z)
        _add("loss: exp inputs below ln(FLT_MIN) (count)", float((z < UNDERFLOW).sum()), float(z.numel()))
        return out
    torch.Tensor.exp = counted_exp
    depth = [0]
    for name in CALLS:
        if hasattr(shm.ShmComm, name):
            _wrap(shm.ShmComm, name, "comm calls", depth)
    _wrap(shm.ShmComm, "spin_until", "comm waits (spin_until)")
    yield_ = shm.os.sched_yield

    def counted():
        _add("comm yields (count)", 1.0)
        yield_()
    shm.os.sched_yield = counted


def _rank(rank, world, tp_only: bool, head_std, args: tuple):
    _instrument()
    if head_std is not None:
        table = T.head_table
        T.head_table = lambda cfg, std=None: table(cfg, head_std)
    steps = []
    timed = PR._timed

    def split(one_step, n, base):
        def step():
            ACC.clear()
            c0, t0 = time.thread_time(), time.perf_counter()
            one_step()
            steps.append({"step": (time.thread_time() - c0, time.perf_counter() - t0), **ACC})
        return {**timed(step, n, base), "split": steps}
    T._timed = split
    return (T._tp_rank if tp_only else T._tp_pp_rank)(rank, world, *args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (1: pp2·tp2, 2: dp2·pp2·tp2)")
    ap.add_argument("--tp-only", action="store_true", help="the tp2 row instead (no pipeline)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--head-std", type=float, help="the 3D rows' head table at this std (default: Hugging Face's 0.02)")
    a = ap.parse_args(argv)
    if a.steps < 2 or a.dp < 1:
        ap.error(f"--steps {a.steps}: expected at least 2" if a.steps < 2 else f"--dp {a.dp}: expected at least 1")
    d = T.distilbert_planner_model("distil-mini", 4, 256, 4, 8192, 128)
    if a.tp_only:
        world, args = 2 * a.dp, (d, 2, 4, a.steps)
    else:
        world, args = 4 * a.dp, (replace(d, tied=False), 2, 2, 4, a.steps)
    got = spawn(_rank, world, args=(a.tp_only, a.head_std, args), timeout=900)
    keys = sorted({k for g in got for s in g["split"] for k in s if k != "step"})
    head = "" if a.tp_only else f", head table std {a.head_std or 'initializer_range'}"
    t = Table(title=f"CPU ms (wall ms) per step, the median of steps 2-{a.steps}, {world} ranks{head}")
    t.add_column("part")
    for r in range(world):
        t.add_column(f"rank {r}", justify="right")

    def med(g, k, i):
        return statistics.median(s.get(k, (0.0, 0.0))[i] for s in g["split"][1:])
    t.add_row("step", *(f"{med(g, 'step', 0) * 1e3:.0f} ({med(g, 'step', 1) * 1e3:.0f})" for g in got))
    for k in keys:
        if "below" in k:
            t.add_row(k.replace("(count)", "(%)"), *(f"{med(g, k, 0) / max(med(g, k, 1), 1) * 100:.0f}" for g in got))
        elif k.endswith("(count)"):
            t.add_row(k, *(f"{med(g, k, 0):.0f}" for g in got))
        else:
            t.add_row(k, *(f"{med(g, k, 0) * 1e3:.1f} ({med(g, k, 1) * 1e3:.0f})" for g in got))
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
