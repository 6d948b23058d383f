"""The allocator's slack and the shared-memory pages of benchmarks.planner_local's rows, measured:
each row run twice, at glibc's defaults and with its mmap threshold fixed at 64 KiB (every large
block mapped, so a freed one leaves the resident set: no slack), beside the planner's count
without slack.

    python -m benchmarks.planner_slack                       # the rows below (~5 min idle)
    python -m benchmarks.planner_slack --only llama          # rows whose name contains the text
    python -m benchmarks.planner_slack --only small --risen  # also with the threshold fixed at glibc's ceiling
    python -m benchmarks.planner_slack --mb 8 --steps 4      # every row at micro-batch 8, 4 steps per run
    python -m benchmarks.planner_slack --only small --steps 4 --arenas 1   # the ranks' malloc in one arena
    python -m benchmarks.planner_slack --only "gpt-cal dp" --steps 4 --mb 2  # DDP, ZeRO-1, ZeRO-2 at the fit's shape
    python -m benchmarks.planner_slack --only small --steps 4 --trim        # the heap trimmed after every step
    python -m benchmarks.planner_slack --steps 4 --eager    # torch's Adam states made before the first step
    python -m benchmarks.planner_slack --only pp2 --steps 6 --variant 131072 --variant trim-bwd --variant reuse

Per row: the peak resident set above the pre-model baseline (as planner_local reads it) of
each rank at the defaults, the larger rank's mapped, their difference (the slack glibc keeps), the
planner's slack (planner.host_memory.allocator_slack, of the stage it counts heavier), the
planner's count without the slack, the shared-memory pages the rank touched (RssShmem after the
steps: planner.memory.shm_bytes's count beside it), the larger rank's peak step by step at the
defaults (a run's peak is its largest step's) and the slower rank's step (median after the first,
as planner_local times it) at the defaults and mapped: what mapping every large block costs a step
(timed beside whatever else runs: say the load). --arenas sets MALLOC_ARENA_MAX for the ranks: if the
slack moved with which thread's arena a block came from (gloo's and torch's threads), one arena
would make it the same from run to run and rank to rank. --trim gives the heap's free pages back
after every step (malloc_trim): if the slack were holes an earlier step left resident, the trimmed
steps would peak at the mapped run's. With --risen a third run fixes the mmap threshold at
32 MiB and the trim threshold at 64 MiB, where glibc's dynamic rise stops (DEFAULT_MMAP_THRESHOLD_MAX,
the trim threshold twice it): if the slack came from how far a row's largest freed block raises the
threshold, this run would give every row the slack of the highest rise. With --eager every torch
Adam/AdamW (the DDP rows', the tp rows', the pipeline engine's) makes its step, m and v when built,
as zero_from_scratch's ZeRO engine does and torch's first step() otherwise would (the same zeros,
so the same updates): if m and v took the room the first step's activations left, the slack would
shrink. Each --variant adds a run per row of what a pipeline engine could do about the slack: a
number fixes the mmap threshold at that many bytes (ZeRO-3's engine's remedy at a size chosen per
stage, e.g. 131072, llama-small's k and v); trim-bwd gives the heap's free pages back after every
micro-batch's backward (malloc_trim(0)); reuse keeps the engine's own blocks across micro-batches
and steps, as DeepSpeed's PipelineEngine keeps its pipe buffers: the gradients zeroed in place
instead of dropped, the receive buffers of activations and gradients pooled by shape. Memory does
not depend on the load; the step columns do: beside the wall step, the slower rank's CPU
seconds a step (thread_time, median after the first), which a loaded machine stretches less.
Cost: two runs of --steps steps (2) per row, 2-4 ranks each, and one per --variant.
"""
from __future__ import annotations

import argparse
import ctypes
import os
from dataclasses import replace

import torch
from rich.table import Table

import benchmarks.planner_ranks as R
import benchmarks.planner_ranks_tp as RT
import pipeline_parallel.executor as X
from benchmarks.planner_fit_engine import CAL
from benchmarks.planner_local import LOCAL_SW
from pipeline_parallel.engine.draining import DrainingExecutor
from planner import hardware as H
from planner.layout import Layout
from planner.memory import memory, shm_bytes
from primitives.launch import spawn
from primitives.log import console

MiB = 2**20
RISEN = 32 * MiB          # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts


def _eager_adam() -> None:
    """Every torch.optim.Adam (AdamW subclasses it) built from here on makes its state at once:
    the tensors torch's _init_group makes at the first step (CPU, neither fused nor capturable)."""
    init = torch.optim.Adam.__init__

    def eager_init(self, params, *a, **k):
        init(self, params, *a, **k)
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p].update(step=torch.tensor(0.0, dtype=torch.get_default_dtype()),
                                         exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                    if group["amsgrad"]:
                        self.state[p]["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    torch.optim.Adam.__init__ = eager_init


def _trim_after_backward(libc) -> None:
    """The pipeline engine gives the heap's free pages back after every micro-batch's backward."""
    bwd = DrainingExecutor.bwd

    def bwd_trimmed(self, op):
        bwd(self, op)
        libc.malloc_trim(0)
    DrainingExecutor.bwd = bwd_trimmed


class _TorchWith:
    """torch as the executor module sees it, with its torch.empty replaced (every other name: torch's)."""

    def __init__(self, empty):
        self.empty = empty

    def __getattr__(self, name):
        return getattr(torch, name)


def _reuse_blocks():
    """The pipeline engine keeps its own blocks: gradients zeroed in place at the step instead of
    dropped (the next step's backward accumulates into them: the same sums, 0 + g = g), and the
    received activations and gradients taken from a pool by shape, returned once their micro-batch's
    backward has used them (the textbook executor's torch.empty, pooled). Returns what undoes it."""
    pool: dict = {}
    saved = X.torch, DrainingExecutor.bwd, DrainingExecutor.send_grad, torch.optim.Optimizer.zero_grad
    _, bwd, send_grad, zero_grad = saved

    def empty(shape, dtype=None, device=None):
        free = pool.get((tuple(shape), dtype))
        return free.pop() if free else torch.empty(shape, dtype=dtype, device=device)

    def give(t):
        if t is not None:
            pool.setdefault((tuple(t.shape), t.dtype), []).append(t.detach())

    def bwd_giving(self, op):
        g = self.grad_in.get((op.mb, op.chunk))
        bwd(self, op)
        give(g)

    def send_grad_giving(self, op):
        x = self.x_in.get((op.mb, op.chunk))
        send_grad(self, op)
        if x is not None:
            x.grad = None
            give(x)

    def undo():
        X.torch, DrainingExecutor.bwd, DrainingExecutor.send_grad, torch.optim.Optimizer.zero_grad = saved
    X.torch = _TorchWith(empty)
    DrainingExecutor.bwd, DrainingExecutor.send_grad = bwd_giving, send_grad_giving
    torch.optim.Optimizer.zero_grad = lambda self, set_to_none=True: zero_grad(self, set_to_none=False)
    return undo


def _row(rank, world, mapped, module: str, fn: str, args: tuple, trim: bool = False, eager: bool = False) -> dict:
    """One rank of a planner_local row; with `mapped` True, glibc's mmap threshold fixed first at
    64 KiB; with "risen", at RISEN (and the trim threshold at twice it, as the dynamic rise sets it);
    with an int, at that many bytes; with "trim-bwd" or "reuse", the pipeline engine so (--variant);
    with `trim`, malloc_trim(0) after every step (each step starts with its heap's free pages given back);
    with `eager`, torch's Adam states made when the optimizer is built."""
    libc = ctypes.CDLL("libc.so.6")
    if mapped == "trim-bwd":
        _trim_after_backward(libc)
    elif mapped == "reuse":
        _reuse_blocks()
    elif isinstance(mapped, int) and not isinstance(mapped, bool):
        libc.mallopt(-3, mapped)                             # M_MMAP_THRESHOLD, fixed at the variant's size
    if eager:
        _eager_adam()
    if trim:
        timed = R._timed

        def timed_trimmed(one_step, steps, base):
            return timed(lambda: (one_step(), libc.malloc_trim(0)), steps, base)
        R._timed = RT._timed = timed_trimmed
    if mapped == "risen":
        libc.mallopt(-3, RISEN)                              # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 * RISEN)                          # M_TRIM_THRESHOLD
    elif mapped is True:
        libc.mallopt(-3, 64 * 1024)
    out = getattr(R if module == "R" else RT, fn)(rank, world, *args)
    return {**out, "shm": R._vm("RssShmem:")}


def rows(steps: int = 2, mb: int | None = None):
    """(name, model, Layout, global batch, module, rank function, its args); `mb` sets every
    row's micro-batch (the dp rows' one micro-batch, the pipelines' four, the tp row's one)."""
    small, mid = R.SHAPES
    distil = RT.distilbert_planner_model("distil-mini", 4, 256, 4, 8192, 128)
    untied = replace(distil, tied=False)     # as benchmarks.planner_local's 3D rows run it
    cal4 = replace(CAL, name="gpt-cal L4", layers=4)     # the calibration shape with an even layer count: two stages
    tiny, lsmall = R.llama_planner_model("tiny", 128), R.llama_planner_model("small", 128)
    d, p, t = mb or 4, mb or 2, mb or 4
    return [("gpt-cal dp2", CAL, Layout(2, 1, 1, mb=d), 2 * d, "R", "_rank", (CAL, d, steps, None)),
            *((f"gpt-cal dp2 Z{z}", CAL, Layout(2, 1, 1, zero=z, mb=d), 2 * d, "R", "_rank", (CAL, d, steps, z)) for z in (1, 2)),
            ("gpt-mini dp2", small, Layout(2, 1, 1, mb=d), 2 * d, "R", "_rank", (small, d, steps, None)),
            *((f"gpt-mini dp2 Z{z}", small, Layout(2, 1, 1, zero=z, mb=d), 2 * d, "R", "_rank", (small, d, steps, z)) for z in (1, 2)),
            ("gpt-small dp2", mid, Layout(2, 1, 1, mb=d), 2 * d, "R", "_rank", (mid, d, steps, None)),
            ("gpt-mini pp2", small, Layout(1, 1, 2, mb=p), 4 * p, "R", "_pp_rank", (small, p, 4, steps)),
            ("gpt-cal L4 pp2", cal4, Layout(1, 1, 2, mb=p), 4 * p, "R", "_pp_rank", (cal4, p, 4, steps)),
            ("distil-mini tp2", distil, Layout(1, 2, 1, mb=t), t, "RT", "_tp_rank", (distil, 2, t, steps)),
            ("distil-mini pp2·tp2", untied, Layout(1, 2, 2, mb=p), 4 * p, "RT", "_tp_pp_rank", (untied, 2, p, 4, steps)),
            ("llama-tiny pp2", tiny, Layout(1, 1, 2, mb=p), 4 * p, "R", "_llama_pp_rank", ("tiny", 128, p, 4, steps)),
            ("llama-small pp2", lsmall, Layout(1, 1, 2, mb=p), 4 * p, "R", "_llama_pp_rank", ("small", 128, p, 4, steps))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose name contains this text")
    ap.add_argument("--risen", action="store_true", help="a third run per row, the mmap threshold fixed at 32 MiB")
    ap.add_argument("--mb", type=int, default=None, help="every row's micro-batch (default: dp and tp 4, pipelines 2)")
    ap.add_argument("--steps", type=int, default=2, help="steps per run (the peak is the largest step's)")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after every step, in both runs")
    ap.add_argument("--eager", action="store_true", help="torch's Adam/AdamW make m and v when built, not at the first step")
    ap.add_argument("--variant", action="append", default=[],
                    help="a further run per row: a threshold in bytes, trim-bwd or reuse (module docstring)")
    ap.add_argument("--arenas", type=int, default=0, help="glibc's arena count for the ranks (MALLOC_ARENA_MAX; 0: its default)")
    a = ap.parse_args(argv)
    variants = [int(v) if v.isdigit() else v for v in a.variant]
    checks = ((a.steps < 2, f"--steps {a.steps}: expected at least 2 (the step columns are medians after the first)"),
              (any(v not in ("trim-bwd", "reuse") and not isinstance(v, int) for v in variants),
               f"--variant: a threshold in bytes, trim-bwd or reuse, got {a.variant}"),
              (a.mb is not None and a.mb < 1, f"--mb {a.mb}: expected a positive micro-batch"),
              (a.arenas < 0, f"--arenas {a.arenas}: expected 0 (glibc's default) or a positive count"))
    bad = [why for failed, why in checks if failed]
    if not bad and not any(a.only in r[0] for r in rows(a.steps, a.mb)):
        bad = [f"--only {a.only!r}: no row's name contains it; the rows: {', '.join(r[0] for r in rows(a.steps, a.mb))}"]
    if bad:
        ap.error("; ".join(bad))
    if a.arenas:      # read when a process starts: the fork server, started by the first spawn, passes it to the ranks
        os.environ["MALLOC_ARENA_MAX"] = str(a.arenas)
    t = Table(title="glibc's slack and the shared-memory pages per rank (MiB, the larger rank)"
                    + (f", MALLOC_ARENA_MAX={a.arenas}" if a.arenas else "") + (", Adam's states made when built" if a.eager else ""))
    for c in ("row", "defaults (each rank)", "mapped", "slack", "the planner's slack", "count without slack", "count / mapped", "RssShmem", "shm_bytes") \
            + (("threshold at 32 MiB", "its slack") if a.risen else ()) + ("defaults per step", "step ms defaults / mapped",
                                                                            "CPU ms defaults / mapped") \
            + tuple(c for v in variants for c in (f"{v}: peak", f"{v}: step / CPU ms")):
        t.add_column(c, justify="right")
    for name, m, lay, batch, module, fn, args in rows(a.steps, a.mb):
        if a.only not in name:
            continue
        la = os.getloadavg()[0]
        if lay.pp == 1 and {"trim-bwd", "reuse"} & set(variants):
            console.print(f"[yellow]warning:[/yellow] {name}: --variant trim-bwd / reuse change the pipeline engine only; "
                          "this row runs without it, so those columns are its defaults again", highlight=False)
        got = {mapped: spawn(_row, lay.gpus, args=(mapped, module, fn, args, a.trim, a.eager), timeout=900)
               for mapped in (False, True) + (("risen",) if a.risen else ()) + tuple(variants)}
        console.print(f"{name}: load average {la:.1f} → {os.getloadavg()[0]:.1f}", highlight=False)
        peak = {k: max(g["peak"] for g in v) / MiB for k, v in got.items()}
        hw = H.cpu_here(lay.gpus)
        pred = memory(m, m.seq, lay, batch, hw, replace(LOCAL_SW, mapped_alloc=True))     # counted without slack
        count = (pred["total"] - pred["reserved"]) / MiB
        rule = memory(m, m.seq, lay, batch, hw, LOCAL_SW)["allocator"] / MiB        # the planner's slack
        t.add_row(name, " / ".join(f"{g['peak'] / MiB:.1f}" for g in got[False]), f"{peak[True]:.1f}", f"{peak[False] - peak[True]:.1f}", f"{rule:.1f}", f"{count:.1f}",
                  f"{count / peak[True] - 1:+.0%}", f"{max(g['shm'] for g in got[False]) / MiB:.1f}",
                  f"{shm_bytes(m, m.seq, lay, hw) / MiB:.1f}",
                  *((f"{peak['risen']:.1f}", f"{peak['risen'] - peak[True]:.1f}") if a.risen else ()),
                  " ".join(f"{p / MiB:.0f}" for p in max(got[False], key=lambda g: g["peak"])["peaks"]),
                  " / ".join(f"{max(g['step'] for g in got[k]) * 1e3:.0f}" for k in (False, True)),
                  " / ".join(f"{max(g['cpu'] for g in got[k]) * 1e3:.0f}" for k in (False, True)),
                  *(c for v in variants for c in (f"{max(g['peak'] for g in got[v]) / MiB:.1f}",
                                                  f"{max(g['step'] for g in got[v]) * 1e3:.0f} / {max(g['cpu'] for g in got[v]) * 1e3:.0f}")))
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
