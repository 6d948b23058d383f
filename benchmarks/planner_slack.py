"""The allocator's slack and the shared-memory pages of benchmarks.planner_local's rows, measured:
each row run twice, at glibc's defaults and with its mmap threshold fixed at 64 KiB (every large
block mapped, so a freed one leaves the resident set: no slack), beside the planner's count
without slack.

    python -m benchmarks.planner_slack                       # the rows below (~5 min idle)
    python -m benchmarks.planner_slack --only llama          # rows whose name contains the text
    python -m benchmarks.planner_slack --only small --risen  # also with the threshold fixed at glibc's ceiling

Per row, the larger rank: the peak resident set above the pre-model baseline (as planner_local
reads it) at the defaults and mapped, their difference (the slack glibc keeps), the planner's
count without the slack, and the shared-memory pages the rank touched (RssShmem after the steps:
planner.memory.shm_bytes's count beside it). With --risen a third run fixes the mmap threshold at
32 MiB and the trim threshold at 64 MiB, where glibc's dynamic rise stops (DEFAULT_MMAP_THRESHOLD_MAX,
the trim threshold twice it): if the slack came from how far a row's largest freed block raises the
threshold, this run would give every row the slack of the highest rise. Memory only: the load does
not enter.
Cost: two runs of 2 steps per row, 2-4 ranks each.
"""
from __future__ import annotations

import argparse
import ctypes
from dataclasses import replace

from rich.table import Table

import benchmarks.planner_ranks as R
import benchmarks.planner_ranks_tp as RT
from benchmarks.planner_fit import CAL
from benchmarks.planner_local import LOCAL_SW
from planner import hardware as H
from planner.layout import Layout
from planner.memory import memory, shm_bytes
from primitives.launch import spawn
from primitives.log import console

MiB = 2**20
RISEN = 32 * MiB          # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts


def _row(rank, world, mapped, module: str, fn: str, args: tuple) -> dict:
    """One rank of a planner_local row; with `mapped` True, glibc's mmap threshold fixed first at
    64 KiB; with "risen", at RISEN (and the trim threshold at twice it, as the dynamic rise sets it)."""
    libc = ctypes.CDLL("libc.so.6")
    if mapped == "risen":
        libc.mallopt(-3, RISEN)                              # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 * RISEN)                          # M_TRIM_THRESHOLD
    elif mapped:
        libc.mallopt(-3, 64 * 1024)
    out = getattr(R if module == "R" else RT, fn)(rank, world, *args)
    return {**out, "shm": R._vm("RssShmem:")}


def rows(steps: int = 2):
    """(name, model, Layout, global batch, module, rank function, its args)."""
    small, mid = R.SHAPES
    distil = RT.distilbert_planner_model("distil-mini", 4, 256, 4, 8192, 128)
    tiny, lsmall = R.llama_planner_model("tiny", 128), R.llama_planner_model("small", 128)
    return [("gpt-cal dp2", CAL, Layout(2, 1, 1, mb=4), 8, "R", "_rank", (CAL, 4, steps, None)),
            ("gpt-mini dp2", small, Layout(2, 1, 1, mb=4), 8, "R", "_rank", (small, 4, steps, None)),
            ("gpt-small dp2", mid, Layout(2, 1, 1, mb=4), 8, "R", "_rank", (mid, 4, steps, None)),
            ("gpt-mini pp2", small, Layout(1, 1, 2, mb=2), 8, "R", "_pp_rank", (small, 2, 4, steps)),
            ("distil-mini tp2", distil, Layout(1, 2, 1, mb=4), 4, "RT", "_tp_rank", (distil, 2, 4, steps)),
            ("llama-tiny pp2", tiny, Layout(1, 1, 2, mb=2), 8, "R", "_llama_pp_rank", ("tiny", 128, 2, 4, steps)),
            ("llama-small pp2", lsmall, Layout(1, 1, 2, mb=2), 8, "R", "_llama_pp_rank", ("small", 128, 2, 4, steps))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose name contains this text")
    ap.add_argument("--risen", action="store_true", help="a third run per row, the mmap threshold fixed at 32 MiB")
    a = ap.parse_args(argv)
    t = Table(title="glibc's slack and the shared-memory pages per rank (MiB, the larger rank)")
    for c in ("row", "defaults", "mapped", "slack", "count without slack", "count / mapped", "RssShmem", "shm_bytes") \
            + (("threshold at 32 MiB", "its slack") if a.risen else ()):
        t.add_column(c, justify="right")
    for name, m, lay, batch, module, fn, args in rows():
        if a.only not in name:
            continue
        got = {mapped: spawn(_row, lay.gpus, args=(mapped, module, fn, args), timeout=900)
               for mapped in (False, True) + (("risen",) if a.risen else ())}
        peak = {k: max(g["peak"] for g in v) / MiB for k, v in got.items()}
        hw = replace(H.cpu_here(lay.gpus), alloc_slack=0.0)
        pred = memory(m, m.seq, lay, batch, hw, LOCAL_SW)
        count = (pred["total"] - pred["reserved"]) / MiB
        t.add_row(name, f"{peak[False]:.1f}", f"{peak[True]:.1f}", f"{peak[False] - peak[True]:.1f}", f"{count:.1f}",
                  f"{count / peak[True] - 1:+.0%}", f"{max(g['shm'] for g in got[False]) / MiB:.1f}",
                  f"{shm_bytes(m, m.seq, lay, hw) / MiB:.1f}",
                  *((f"{peak['risen']:.1f}", f"{peak['risen'] - peak[True]:.1f}") if a.risen else ()))
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
