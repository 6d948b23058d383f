"""Root cause on every rank: when a peer fails, name the rank that actually died.

A dead rank is often not the one a survivor was waiting for: with rank 2 killed mid ring, rank
0 (waiting on 2) gives up first and exits, and rank 1 (waiting on 0) then sees rank 0 vanish
and would blame it. So every rank that detects a failed peer writes a report to the process
group's store (out of band: it does not depend on the broken data path) before raising:

    ringzero/fault/report/<my global rank> = {suspect, call, what}

and reads the others'. A rank that wrote a report is alive by definition, so the root cause is
a suspect that did not report itself; the first such report (store compare_set: atomic, first
writer wins) also gives the collective and call number where the failure was first seen. A
survivor waits at most GRACE seconds for that evidence, then names its own suspect. Without a
torch.distributed store (MPI), nothing is recorded and the message names the peer, as before.
"""
from __future__ import annotations

import json
import time

import torch.distributed as dist

GRACE = 1.0      # seconds a failing rank waits for another rank's report
PREFIX = "ringzero/fault"


def _store():
    try:
        if not dist.is_initialized():
            return None, 0
        return dist.distributed_c10d._get_default_store(), dist.get_world_size()
    except Exception:
        return None, 0


def note(comm, peer: int, what: str, certain: bool, store=None) -> str:
    """Write this rank's report (suspect `peer`) to the store, before this rank raises and exits:
    the survivors then know it was alive and do not blame it. Returns the report."""
    store = store if store is not None else _store()[0]
    me, suspect = comm.global_rank(comm.rank), comm.global_rank(peer)
    mine = json.dumps({"by": me, "suspect": suspect, "call": str(getattr(comm, "current_call", "") or "point-to-point"),
                       "what": what, "certain": certain})
    try:
        if store is not None:
            store.set(f"{PREFIX}/report/{me}", mine)
    except Exception:             # the store itself may live on the dead rank
        pass
    return mine


def reported(comm, peer: int) -> bool:
    """Did group rank `peer` write a failure report? Then it was alive when it saw another rank
    fail, and a survivor that finds its process gone afterwards (it raised and exited) must not
    name it as the rank that died."""
    store, _ = _store()
    if store is None:
        return False
    try:
        return store.check([f"{PREFIX}/report/{comm.global_rank(peer)}"])
    except Exception:             # the store itself may live on the dead rank
        return False


def root_cause(comm, peer: int, what: str, certain: bool = False) -> str:
    """Record this detection and return ' root cause: …' naming the rank that died (or '').
    certain: the transport saw `peer` die (shm: its pid is gone), not merely stop answering;
    such a report outranks a first report that only blamed the peer it was waiting on."""
    store, world = _store()
    if store is None:
        return ""
    try:
        mine = note(comm, peer, what, certain, store)
        first = json.loads(store.compare_set(f"{PREFIX}/first", "", mine).decode())
        deadline = time.monotonic() + GRACE
        while True:
            reports = {}
            for r in range(world):
                k = f"{PREFIX}/report/{r}"
                if store.check([k]):
                    reports[r] = json.loads(store.get(k).decode())
            dead = [rep for rep in reports.values() if rep["suspect"] not in reports]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception:             # the store itself may live on the dead rank (torchrun's TCPStore)
        return ""
    if not dead:
        return ""
    certain_dead = [d for d in dead if d.get("certain")]
    if certain_dead:            # e.g. rank 1 waiting on a live rank 0 while shm saw rank 2's pid vanish
        rep = min(certain_dead, key=lambda d: d["by"])
    else:
        rep = first if first["suspect"] not in reports else min(dead, key=lambda d: d["by"])
    return (f" Root cause: rank {rep['suspect']} stopped answering (it died or skipped the call; first detected by rank {rep['by']} in "
            f"{rep['call']}, {rep['what']} it).")
