"""Where an algorithm="shm" all-reduce spends its time: memory work (torch copies and adds)
vs waiting for peers (futex sleeps and wake-ups) vs the rest (Python), on rank 0.

    torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --size 64M
    RINGZERO_SHM_WORKSPACE=16777216 torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --size 64M
    torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --default --size 4K --iters 5000
                                           (the default call, no algorithm passed: where its µs go)
    torchrun --standalone --nproc_per_node 4 benchmarks/shm_profile.py --default --size 4 --iters 3000
                                           (4 ranks on 2 cores: the waits are the scheduler's)

    torchrun --standalone --nproc_per_node 4 benchmarks/shm_profile.py --waits --size 4 --iters 300
                                           (how a rank waits, three ways in turn)
    chrt -r 5 torchrun --standalone --nproc_per_node 4 benchmarks/shm_profile.py --timeline --size 4 --iters 30
                                           (each rank's flags timed: its own work per call, the hand-offs)
    torchrun --standalone --nproc_per_node 4 benchmarks/shm_profile.py --items --size 4 --iters 300
                                           (a few floats replayed item by item vs through torch ops, in turn)

cProfile around --iters calls after warm-up (checked: the default), grouped by function. --waits times
the default call without cProfile under three waiting policies of ShmComm.spin_until, batches in turn
(--reps each): `adaptive` (the default: yield while yields come back fast, sleep on the futex for a
second after one that ran another process's slice), `yield` (always yield first: an idle machine's best
when ranks outnumber cores), `sleep` (futex at once); per call, the slowest rank's time, and on rank 0
the time spent in spin_until and the sched_yield and futex_wait calls it made. --timeline stamps
every rank's calls, flags and waits with the time and the core it ran on (`chrt -r 5`: real-time
priority keeps other jobs off the cores, as on an idle machine; the ranks still yield to each other):
per rank, its own work per call (from a wait's end or a call's start to the next wait); per core,
the hand-offs (a rank starts waiting -> the other rank on that core resumes) and what they cost.
--items times the default call in batches of --iters, in turn (--reps each): its plan replaying a few
floats item by item over memoryviews (planned.ITEMS, the default) and through torch ops (ITEMS = 0);
per call, the slowest rank's time, each batch after the plans are rebuilt and warmed up.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import primitives as P
from primitives.engine import planned, shm_collectives, shm_segment
from benchmarks.collectives import parse_size
from benchmarks.one_host_worker import slowest
from primitives.launch import init_from_env
from primitives.log import print0

GROUPS = {"memory (copy_, add, ...)": ("copy_", "add", "mul", "minimum", "maximum"),
          "waiting (futex sleep + wake, sched_yield)": ("futex_wait", "futex_wake", "sched_yield")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="64M")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--default", action="store_true", help="profile primitives.all_reduce(x) with no algorithm passed")
    mode = ap.add_mutually_exclusive_group()     # each mode makes the default call (--default is implied)
    mode.add_argument("--waits", action="store_true", help="the default call under three waiting policies, in turn")
    mode.add_argument("--timeline", action="store_true", help="each rank's flags and waits timed: work and hand-offs")
    mode.add_argument("--items", action="store_true", help="a few floats item by item vs torch ops, in turn")
    ap.add_argument("--reps", type=int, default=5, help="--waits / --items: batches per way")
    args = ap.parse_args(argv)
    comm = init_from_env("gloo")
    P.LEDGER.keep_calls = False
    x = torch.zeros(max(1, parse_size(args.size) // 4))
    if args.waits:
        return waits(comm, x, args)
    if args.timeline:
        return timeline(comm, x, args)
    if args.items:
        return items(comm, x, args)
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


def waits(comm, x, args) -> None:
    """The default call, batches of --iters in turn under each waiting policy; counters on rank 0."""
    count = dict(sched_yield=0, futex_wait=0, wait_s=0.0)
    real_yield, real_futex, real_spin = os.sched_yield, shm_segment.futex_wait, comm.spin_until

    def counted(name, fn):
        def call(*a):
            count[name] += 1
            return fn(*a)
        return call

    def spin_until(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_spin(*a, **k)
        finally:
            count["wait_s"] += time.perf_counter() - t0
    os.sched_yield, shm_segment.futex_wait = counted("sched_yield", real_yield), counted("futex_wait", real_futex)
    comm.spin_until, yield_s, slow = spin_until, comm.yield_s, shm_segment.YIELD_SLOW
    policies = {"adaptive": (yield_s, slow), "yield": (yield_s, float("inf")), "sleep": (0.0, slow)}
    rows = {k: [] for k in policies}
    for _ in range(args.reps):
        for name, (comm.yield_s, shm_segment.YIELD_SLOW) in policies.items():
            comm.calm = 0.0
            shm_collectives.state(comm).polls = shm_collectives.state(comm).max_polls
            P.all_reduce(x)
            dist.barrier()
            count.update(sched_yield=0, futex_wait=0, wait_s=0.0)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                P.all_reduce(x)
            mine = time.perf_counter() - t0
            rows[name].append((slowest(mine / args.iters), mine, *count.values()))
    os.sched_yield, shm_segment.futex_wait, comm.spin_until = real_yield, real_futex, real_spin
    comm.yield_s, shm_segment.YIELD_SLOW = yield_s, slow
    print0(f"all_reduce of {x.numel() * 4:,} B, {comm.size} ranks on {len(os.sched_getaffinity(0))} cores, "
           f"{args.reps} batches of {args.iters} calls per policy, in turn; load {os.getloadavg()[0]:.1f}")
    print0(f"  {'policy':9s} {'µs/call':>9s} {'rank 0: waiting':>16s} {'the rest':>9s} {'yields':>7s} {'sleeps':>7s}")
    for name, r in rows.items():
        med = lambda i: statistics.median(v[i] for v in r)  # noqa: E731
        per = args.iters / 1e6
        print0(f"  {name:9s} {med(0) * 1e6:9.1f} {med(4) / per:16.1f} {(med(1) - med(4)) / per:9.1f} "
               f"{med(2) / args.iters:7.1f} {med(3) / args.iters:7.2f}")


def items(comm, x, args) -> None:
    """The default call, batches of --iters in turn: item by item (planned.ITEMS) and through torch ops."""
    ways, rows = {"items": planned.ITEMS, "torch ops": 0}, {}
    for _ in range(args.reps):
        for name, planned.ITEMS in ways.items():
            planned.forget()                        # the next call plans again, under this setting
            for _ in range(20):
                P.all_reduce(x)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                P.all_reduce(x)
            rows.setdefault(name, []).append(slowest((time.perf_counter() - t0) / args.iters))
    planned.ITEMS = ways["items"]
    med = {k: statistics.median(v) for k, v in rows.items()}
    print0(f"all_reduce of {x.numel() * 4:,} B, {comm.size} ranks on {len(os.sched_getaffinity(0))} cores, "
           f"{args.reps} batches of {args.iters} calls per way, in turn; load {os.getloadavg()[0]:.1f}")
    for k, v in rows.items():
        print0(f"  {k:9s} {med[k] * 1e6:8.1f} µs/call (min {min(v) * 1e6:.1f}, max {max(v) * 1e6:.1f})")
    print0(f"  item by item / torch ops: {med['items'] / med['torch ops']:.2f}")


def timeline(comm, x, args) -> None:
    """(time, event, core) per rank: C a call starts, W a wait starts, w it ended; gathered on rank 0."""
    core, st, ev = ctypes.CDLL(None).sched_getcpu, shm_collectives.state(comm), []
    real_wait = st.wait

    def wait(*a):
        ev.append((time.perf_counter(), "W", core()))
        real_wait(*a)
        ev.append((time.perf_counter(), "w", core()))
    st.wait = wait
    for _ in range(20):
        P.all_reduce(x)
    dist.barrier()
    ev.clear()
    for _ in range(args.iters):
        ev.append((time.perf_counter(), "C", core()))
        P.all_reduce(x)
    ev.append((time.perf_counter(), "W", core()))
    st.wait = real_wait
    every = [None] * comm.size
    dist.all_gather_object(every, ev)
    if comm.rank:
        return
    evs = sorted((t, r, k, c) for r, e in enumerate(every) for t, k, c in e)
    busy, since, hand = [0.0] * comm.size, {}, []
    for i, (t, r, k, c) in enumerate(evs):
        if k in "Cw":
            since.setdefault(r, t)                    # from a wait's end through the next call's start
        elif r in since:
            busy[r] += t - since.pop(r)
            nxt = next((e for e in evs[i + 1:] if e[3] == c and e[2] == "w"), None)   # who resumes on this core
            if nxt is not None and nxt[1] != r:
                hand.append(nxt[0] - t)
    span = (evs[-1][0] - evs[0][0]) / args.iters * 1e6
    print0(f"all_reduce of {x.numel() * 4:,} B, {comm.size} ranks on {len(os.sched_getaffinity(0))} cores, "
           f"{args.iters} calls timed flag by flag; load {os.getloadavg()[0]:.1f}")
    print0(f"  per call {span:.1f} µs; each rank's own work per call: "
           + ", ".join(f"{b / args.iters * 1e6:.1f}" for b in busy) + " µs")
    if hand:
        print0(f"  hand-offs (a rank waits -> its core's other rank resumes): {len(hand) / args.iters:.2f} per call, "
               f"median {statistics.median(hand) * 1e6:.1f} µs")


if __name__ == "__main__":
    main()
