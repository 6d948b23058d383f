"""Where an algorithm="shm" all-reduce spends its time: memory work (torch copies and adds)
vs waiting for peers (futex sleeps and wake-ups) vs the rest (Python), on rank 0.

    torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --size 64M
    RINGZERO_SHM_WORKSPACE=16777216 torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --size 64M

cProfile around --iters calls after warm-up (checked: the default), grouped by function.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import primitives as P
from primitives.engine import shm_segment
from benchmarks.collectives import parse_size
from primitives.launch import init_from_env
from primitives.log import print0

GROUPS = {"memory (copy_, add, ...)": ("copy_", "add", "mul", "minimum", "maximum"),
          "waiting (futex sleep + wake)": ("futex_wait", "futex_wake")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="64M")
    ap.add_argument("--iters", type=int, default=6)
    args = ap.parse_args(argv)
    comm = init_from_env("gloo")
    P.LEDGER.keep_calls = False
    x = torch.zeros(parse_size(args.size) // 4)
    for _ in range(2):
        P.all_reduce(x, algorithm="shm")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.iters):
        P.all_reduce(x, algorithm="shm")
    prof.disable()
    total = (time.perf_counter() - t0) / args.iters
    stats = pstats.Stats(prof).stats
    own = {g: 0.0 for g in GROUPS}
    for (_, _, fn), (_, _, tottime, _, _) in stats.items():
        for g, names in GROUPS.items():
            if any(fn == n or f"'{n}'" in fn or fn.endswith(f"torch.{n}>") for n in names):
                own[g] += tottime
    print0(f"all_reduce(algorithm='shm') of {x.numel() * 4:,} B, {comm.size} ranks, workspace rounds of "
           f"{shm_segment.WS_BYTES:,} B, rank 0, {args.iters} calls, torch {torch.__version__}:")
    print0(f"  per call {total * 1e3:8.1f} ms (under cProfile)")
    for g, s in own.items():
        print0(f"  {g:30s} {s / args.iters * 1e3:8.1f} ms")
    print0(f"  {'the rest (Python, views, flags)':30s} {(total - sum(own.values()) / args.iters) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
