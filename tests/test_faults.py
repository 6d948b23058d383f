"""A rank dies mid-collective: every survivor's PeerError names the rank that died (not the
neighbour that gave up first), with the collective and its call number (primitives/engine/faults.py).

20 runs in a row: N = 3 and 4, the dead rank cycling through every rank, killed during the ring
phase of the second all-reduce (after the check round). Short timeouts keep a failure fast: a
gloo peer that vanishes is noticed at once (its sockets close), so no run waits for a deadline.
"""
import os
import time

import torch

import primitives as P
from primitives.engine.launch import spawn

RUNS = [(3, i % 3) for i in range(10)] + [(4, i % 4) for i in range(10)]


def _dies_in_call_2(rank, n, dead):
    comm = P.get_comm()
    if rank == dead:
        sent, orig = [0], comm._group
        limit = (n - 1) + 2 * (n - 1) + (n - 1) + 1      # call 1: check + ring; call 2: check + 1 step

        def group(ops):
            sent[0] += sum(kind == "send" for kind, _, _ in ops)
            if sent[0] > limit:
                os._exit(3)
            return orig(ops)
        comm._group = group
    try:
        for _ in range(3):
            P.all_reduce(torch.ones(40_000), algorithm="ring")   # 160 kB: larger than an envelope
        return "returned", ""
    except Exception as e:
        return type(e).__name__, str(e)


def test_every_survivor_names_the_dead_rank_20_runs():
    problems, t0 = [], time.monotonic()
    for n, dead in RUNS:
        res = spawn(_dies_in_call_2, n, args=(dead,), comm_timeout=10, grace=12, allow_fail=True, timeout=60)
        if res[dead] != ("exit", 3):
            problems.append(f"N={n} dead={dead}: the dead rank reported {res[dead]}")
        for r, (status, value) in enumerate(res):
            if r == dead:
                continue
            etype, msg = value if status == "ok" else (status, str(value))
            want = [f"rank {r}: failed", f"Root cause: rank {dead} stopped answering",
                    "all_reduce(algorithm=ring) call #2"]
            if etype != "PeerError" or any(w not in msg for w in want):
                problems.append(f"N={n} dead={dead} rank {r}: {etype}: {msg[:400]}")
    assert not problems, f"{len(problems)} problems in {len(RUNS)} runs:\n" + "\n".join(problems[:10])
    assert time.monotonic() - t0 < 240
