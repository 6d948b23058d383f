"""Where an algorithm="shm" all-reduce spends its time: memory work (torch copies and adds)
vs waiting for peers (futex sleeps and wake-ups) vs the rest (Python), on rank 0.

    torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --size 64M
    RINGZERO_SHM_WORKSPACE=16777216 torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --size 64M
    torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --default --size 4K --iters 5000
                                           (the default call, no algorithm passed: where its µs go)
    torchrun --standalone --nproc_per_node 4 benchmarks/shm_profile.py --default --size 4 --iters 3000
                                           (4 ranks on 2 cores: the waits are the scheduler's)

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
          "waiting (futex sleep + wake, sched_yield)": ("futex_wait", "futex_wake", "sched_yield")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="64M")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--default", action="store_true", help="profile primitives.all_reduce(x) with no algorithm passed")
    args = ap.parse_args(argv)
    comm = init_from_env("gloo")
    P.LEDGER.keep_calls = False
    x = torch.zeros(parse_size(args.size) // 4)
    kw = {} if args.default else {"algorithm": "shm"}
    for _ in range(2 if not args.default else 200):
        P.all_reduce(x, **kw)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.iters):
        P.all_reduce(x, **kw)
    prof.disable()
    total = (time.perf_counter() - t0) / args.iters
    stats = pstats.Stats(prof).stats
    calls = sum(nc for (nc, _, _, _, _) in stats.values()) / args.iters
    engine = sorted(((ct, fn) for (f, _, fn), (_, _, _, ct, _) in stats.items() if "/primitives/" in f), reverse=True)
    own = {g: 0.0 for g in GROUPS}
    for (_, _, fn), (_, _, tottime, _, _) in stats.items():
        for g, names in GROUPS.items():
            if any(fn == n or f"'{n}'" in fn or fn.endswith((f"torch.{n}>", f"posix.{n}>")) for n in names):
                own[g] += tottime
    how = "" if args.default else "algorithm='shm'"
    print0(f"all_reduce({how}) of {x.numel() * 4:,} B, {comm.size} ranks, workspace rounds of "
           f"{shm_segment.WS_BYTES:,} B, rank 0, {args.iters} calls, torch {torch.__version__}:")
    u, scale = ("µs", 1e6) if total < 1e-3 else ("ms", 1e3)
    print0(f"  per call {total * scale:8.1f} {u} (under cProfile), {calls:.0f} function calls")
    for g, s in own.items():
        print0(f"  {g:30s} {s / args.iters * scale:8.1f} {u}")
    print0(f"  {'the rest (Python, views, flags)':30s} {(total - sum(own.values()) / args.iters) * scale:8.1f} {u}")
    print0("  cumulative per call, the ten outermost primitives/ frames:")
    for ct, fn in engine[:10]:
        print0(f"    {fn:40s} {ct / args.iters * scale:8.1f} {u}")


if __name__ == "__main__":
    main()
