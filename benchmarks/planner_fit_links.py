"""The links and the waits between ranks on this host, for planner_fit's cpu-here file: the
shared-memory link per number of ranks as a ring's α-β, and the wait a blocking collective pays
for a descheduled member once ranks outnumber the cores (benchmarks/planner_fit.py's docstring
says how each is read).

    python -m benchmarks.planner_fit --links         # the links, into this processor's cpu_here.json (~1 min)
    python -m benchmarks.planner_fit --waits         # the waits, likewise (~1-2 min)

Cost: 2 and 4 ranks × 6 sizes × 15 all-reduces (links); 2, 3, 4, 8 ranks × 60 iterations of 4 ms
of CPU each, and the probe's 2 s before each (waits).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

import primitives as P
from planner.probe import Probe, Sleeper, read_for
from primitives.launch import spawn

LINK_SIZES = (2**10, 2**14, 2**18, 2**20, 2**22, 2**24)


def link_rank(rank: int, world: int, reps: int, stat=min) -> list[float]:
    """The fastest (stat) wall time of an all-reduce of each LINK_SIZES bytes, lined up by a tiny one first."""
    out = []
    for nbytes in LINK_SIZES:
        x, times = torch.ones(nbytes // 4), []
        for _ in range(reps):
            P.all_reduce(torch.zeros(1))
            t0 = time.perf_counter()
            P.all_reduce(x)
            times.append(time.perf_counter() - t0)
        out.append(stat(times))
    return out


def link_fit(n: int, reps: int = 15, stat=min) -> dict:
    """The link of n ranks on this host as a ring's α-β (module docstring), the slower rank's times.
    stat=statistics.median reads the typical try instead of the unimpeded one; the tries run back
    to back, lined up, so neither sees the wait of ranks that compute between calls (wait_fit;
    planner.cpu_host.wait_time counts it apart): the file keeps the fastest."""
    got = spawn(link_rank, n, args=(reps, stat), timeout=900)
    t = [max(g[i] for g in got) for i in range(len(LINK_SIZES))]
    alpha = t[0] / (2 * (n - 1))
    beta = statistics.median((ti - 2 * (n - 1) * alpha) / (2 * (n - 1) / n * S)
                             for S, ti in zip(LINK_SIZES, t) if S >= 2**20)
    return {"alpha": alpha, "beta": max(beta, 0.0), "gamma": 0.0, "o": 0.0}


WAIT_RANKS, WAIT_WORK, WAIT_ITERS = (2, 3, 4, 8), 4e-3, 60
WAIT_KEYS = ("ranks", "load", "over", "wait_s", "cpu_s")    # a row of wait_fit; cpu_s: a rank's CPU per iteration beyond its work


def wait_rank(rank: int, world: int, work: float, iters: int) -> tuple[float, float]:
    """(wall, CPU) seconds per iteration of `work` CPU seconds of matmuls then a 4-byte all-reduce."""
    torch.set_num_threads(1)
    a, b, x = torch.randn(64, 64), torch.randn(64, 64), torch.zeros(1)
    P.all_reduce(x)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        end = time.thread_time() + work
        while time.thread_time() < end:
            a @ b
        P.all_reduce(x)
    return (time.perf_counter() - t0) / iters, (time.thread_time() - c0) / iters


def wait_fit(ranks=WAIT_RANKS, work: float = WAIT_WORK, iters: int = WAIT_ITERS) -> tuple[float, list]:
    """(wait_s, rows): the wait per blocking collective per unit of the ranks' oversubscription
    (module docstring), and per N a dict of WAIT_KEYS: N, the load, the oversubscription, the wait,
    and the CPU seconds a rank spent per iteration beyond its work (the all-reduce's, with its yields
    and the context switches it pays for: not part of wait_s, recorded to compare processors)."""
    cores = os.cpu_count()
    probe, sleeper = Probe(cores), Sleeper()
    rows = []
    try:
        for p in (probe, sleeper):
            p.start()
        for p in (probe, sleeper):
            p.ready()
            p.pause()
        for n in ranks:
            probe.samples, sleeper.samples = [], []
            w = read_for([probe, sleeper], 2.0)
            probe.within([w])
            sleeper.within([w])
            load = probe.load(sleeper.used())
            got = spawn(wait_rank, n, args=(work, iters), timeout=900)
            wall, cpu_s = max(g[0] for g in got), statistics.mean(g[1] for g in got)
            over = max(0.0, n - cores) / cores * (cores + load) / cores     # planner.cpu_host.wait_time
            rows.append(dict(zip(WAIT_KEYS, (n, load, over, wall - cpu_s * max(1.0, (n + load) / cores), cpu_s - work))))
    finally:
        probe.stop()
        sleeper.stop()
    xs, ys = [r["over"] for r in rows], [r["wait_s"] for r in rows]
    wait_s = max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)) if any(xs) else 0.0
    return wait_s, rows
