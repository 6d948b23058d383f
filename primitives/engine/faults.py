"""Root cause on every rank: when a peer fails, name the rank that actually died, once, with the evidence.

    python -m pytest -q -x tests/test_faults.py        (a rank killed before, during and after set-up)

A dead rank is often not the one a survivor was waiting for: with rank 2 killed mid ring, rank
0 (waiting on 2) gives up first and exits, and rank 1 (waiting on 0) then sees rank 0 vanish
and would blame it. So every rank keeps its evidence in the process group's store (out of band:
it does not depend on the broken data path), under ringzero/fault/:

    hello/<global rank>   = {host, pid, start}  written once the process group exists
                            (launch.py; communicator set-up writes it too)
    report/<global rank>  = {by, suspect, call, what, evidence, t}  written by a rank that saw a
                            peer fail, *before* it raises and exits

A rank that wrote a report was alive when it saw the failure, so it is never the root cause.
The root cause is a rank without a report for which there is evidence of death:
  * pid gone: its hello names a process on this host (pid + start time, so a reused pid does
    not count) that no longer exists;
  * connection closed: a report says its socket closed under a transfer (gloo TCP): the process
    exited. Reports are written before a rank exits, so whoever reads a report after seeing the
    closure also sees the closing rank's own report, if it had one;
  * report missing: it never arrived at communicator set-up before the deadline (Rounds, below).
A survivor waits at most GRACE seconds for that evidence; then it names the rank it was waiting
on as one that stopped answering (alive but absent: it skipped the call or waits elsewhere).
The store lives in one process (rank 0 of an env:// or tcp:// start; under torchrun its agent):
if that rank gave up first and exited, the store and every report would go with it, and a later
survivor could name nobody. So the rank hosting the store, once it named the dead rank, stays
until every other rank has reported or is gone (at most LINGER seconds): a failure path only.
Cost: nothing until a failure; then a few store reads per 50 ms for at most GRACE seconds.
Without a torch.distributed store (MPI) nothing is recorded and the message names the peer.

Communicator set-up goes through the same store (Rounds, below): the arrival round of every
transport (TCP, nccl, shared memory), then the shared-memory rendezvous's own rounds
(shm_segment.rendezvous). A backend all_gather_object would fail with "Connection closed by
peer" and no rank in it, or wait for a rank that is gone; here each rank writes
    ringzero/setup/<group name>.<n-th build>/<round>/<global rank> = pickle(obj)
and, while it waits, checks each missing peer: its process gone (gone()), or a failure report
from it (it saw another rank die and gave up: the chain leads to the dead one). At the deadline
(the communicator's timeout) the ranks still missing are named as never arrived.
Cost per round: 1 store write + (N-1) reads per rank; nothing travels on the data path.
"""
from __future__ import annotations

import json
import os
import pickle
import time
from collections import Counter

import torch.distributed as dist

from primitives.engine.errors import PeerError
from primitives.engine.shm_segment import host_key, start_time

GRACE = 1.0      # seconds a failing rank waits for evidence of a death
LINGER = 10.0    # seconds the rank hosting the store stays after naming a death, for the others
PREFIX = "ringzero/fault"
# evidence, as the predicate of "rank D ...": what a survivor saw of the dead rank
PID_GONE = "died: its process (pid {pid}) is gone: it exited or was killed"
CLOSED = "died: its connection closed under a transfer: its process exited"
_CLOSED_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
_HELLOS: dict = {}   # (id(store), global rank) -> hello record: a process never changes host or pid


def store():
    """(the default process group's store, world size), or (None, 0) without one (MPI)."""
    try:
        if not dist.is_initialized():
            return None, 0
        return dist.distributed_c10d._get_default_store(), dist.get_world_size()
    except Exception:
        return None, 0


def hello() -> None:
    """Publish this process's host, pid and start time: evidence a peer can check if it vanishes."""
    st, _ = store()
    if st is None:
        return
    pid = os.getpid()
    try:
        st.set(f"{PREFIX}/hello/{dist.get_rank()}", json.dumps({"host": host_key(), "pid": pid,
                                                                "start": start_time(pid)}))
    except Exception:           # a store that is already gone: nothing to publish into
        pass


def closed(err) -> bool:
    """Did the transport report that the peer's socket closed (its process exited)?"""
    return err is not None and any(w in str(err) for w in _CLOSED_WORDS)


def gone(st, g: int) -> str | None:
    """Evidence that global rank g's process is gone (it must be on this host), else None."""
    key = (id(st), g)
    if key not in _HELLOS:
        k = f"{PREFIX}/hello/{g}"
        if not st.check([k]):
            return None
        _HELLOS[key] = json.loads(st.get(k).decode())
    h = _HELLOS[key]
    if h["host"] != host_key() or h["pid"] == os.getpid():
        return None
    return None if start_time(h["pid"]) == h["start"] else PID_GONE.format(pid=h["pid"])


def report_of(st, g: int) -> dict | None:
    """Global rank g's failure report, or None."""
    k = f"{PREFIX}/report/{g}"
    return json.loads(st.get(k).decode()) if st.check([k]) else None


def culprits(st, world: int) -> tuple[dict, dict]:
    """({global rank: evidence} for every rank without a report that is known to be dead, the
    reports). Processes are checked first, reports read after: a rank writes its report before
    it exits, so one seen gone with no report then died without one."""
    ended = {g: ev for g in range(world) if (ev := gone(st, g))}
    reps = {g: rep for g in range(world) if (rep := report_of(st, g))}
    dead = {g: ev for g, ev in ended.items() if g not in reps}
    for rep in reps.values():
        s = rep["suspect"]
        if rep.get("evidence") and s >= 0 and s not in reps and s not in dead:
            dead[s] = rep["evidence"]
    return dead, reps


def attribute(comm, peer: int | None, what: str, evidence: str | None = None,
              call: str | None = None) -> tuple[int | None, str]:
    """Record this rank's failure report, then find the root cause.
    peer: the group rank this rank was waiting on (None: unknown); evidence: what this rank saw
    of `peer`'s death as a predicate (PID_GONE, CLOSED, "never arrived at ..."), None if it only
    stopped answering; call: where (default: the communicator's current call).
    Returns (global rank named, ' Root cause: rank D ...') or (None, '') without a store."""
    st, world = store()
    if st is None:
        return None, ""
    me = comm.global_rank(comm.rank)
    suspect = -1 if peer is None else comm.global_rank(peer)
    call = call or str(getattr(comm, "current_call", "") or "point-to-point")
    mine = {"by": me, "suspect": suspect, "call": call, "what": what, "evidence": evidence, "t": time.time()}
    try:
        st.set(f"{PREFIX}/report/{me}", json.dumps(mine))
        first = json.loads(st.compare_set(f"{PREFIX}/first", "", json.dumps(mine)).decode())
        deadline = time.monotonic() + GRACE
        while True:
            dead, reps = culprits(st, world)
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception:             # the store itself may live on the dead rank
        return None, ""
    if dead and hosts_store():
        linger(st, world, me, dead)
    if dead:
        d = first["suspect"] if first["suspect"] in dead else min(dead)
        by = first if first["suspect"] == d else next((r for r in sorted(reps.values(), key=lambda r: r["by"])
                                                       if r["suspect"] == d), mine)
        return d, (f" Root cause: rank {d} {dead[d]} (first detected by rank {by['by']} "
                   f"in {by['call']}, {by['what']} it).")
    # no evidence of a death: name the rank waited on that did not itself report a failure
    quiet = [r for r in [first, mine, *reps.values()] if r["suspect"] >= 0 and r["suspect"] not in reps]
    if not quiet:
        return None, ""
    rep = quiet[0]
    return rep["suspect"], (f" Root cause: rank {rep['suspect']} stopped answering (it died or skipped the call; "
                            f"first detected by rank {rep['by']} in {rep['call']}, {rep['what']} it).")


def hosts_store() -> bool:
    """Does this process host the process group's store (rank 0 of an env:// or tcp:// start)?"""
    st, _ = store()
    while hasattr(st, "underlying_store"):
        st = st.underlying_store
    return type(st).__name__ == "TCPStore" and dist.get_rank() == 0 and "TORCHELASTIC_RUN_ID" not in os.environ


def linger(st, world: int, me: int, dead: dict) -> None:
    """Stay (≤ LINGER s) until every rank but me and the dead has reported a failure or is gone."""
    end = time.monotonic() + LINGER
    left = [g for g in range(world) if g != me and g not in dead]
    try:
        while left and time.monotonic() < end:
            left = [g for g in left if not st.check([f"{PREFIX}/report/{g}"]) and not gone(st, g)]
            time.sleep(0.02)
    except Exception:
        pass


# ----------------------------------------------------------------------------- set-up rounds

_BUILDS: Counter = Counter()    # group name -> communicators built for it in this process


class Rounds:
    """The set-up rounds of one communicator (every rank of its group builds it in the same order)."""

    def __init__(self, comm, what: str):
        self.comm, self.what, self.round = comm, what, 0
        name = getattr(comm.group, "group_name", None) or "world"
        _BUILDS[name] += 1
        self.tag = f"ringzero/setup/{name}.{_BUILDS[name]}"
        self.store, _ = store()
        self.t0 = time.time() - 1.0                 # reports older than this set-up are another failure's

    def gather(self, obj) -> list:
        """Every group rank's obj (a list indexed by group rank); PeerError naming the absent rank."""
        c = self.comm
        self.round += 1
        if self.store is None or c.size == 1:
            return [obj] if c.size == 1 else self._fallback(obj)
        try:
            return self._gather(obj)
        except PeerError:
            raise
        except Exception as e:        # DistStoreError, ConnectionResetError: the store itself is gone
            raise PeerError(f"rank {c.rank}: communicator set-up failed at {self.where()}: the process group's "
                            f"store is unreachable ({type(e).__name__}: {e}); the process hosting it (rank 0, or "
                            "the launcher's agent under torchrun) exited or was killed") from e

    def _gather(self, obj) -> list:
        c = self.comm
        key = f"{self.tag}/{self.round}/"
        self.store.set(key + str(c.global_rank(c.rank)), pickle.dumps(obj))
        pending = [p for p in range(c.size) if p != c.rank]
        deadline, nap = time.monotonic() + c.timeout, 1e-3
        while True:
            pending = [p for p in pending if not self.store.check([key + str(c.global_rank(p))])]
            if not pending:
                break
            for p in pending:
                ev = gone(self.store, c.global_rank(p))
                rep = report_of(self.store, c.global_rank(p))
                # dead, or it gave up on a dead rank while I waited; and (a key is written before its
                # rank can exit) still absent now, not one that arrived and died just after
                if (ev or (rep and rep["t"] >= self.t0)) and not self.store.check([key + str(c.global_rank(p))]):
                    self._absent(p, ev)
            if time.monotonic() > deadline:
                self._absent(pending[0], f"never arrived at {self.where()} within {c.timeout:.0f}s "
                                         f"(ranks still missing: {pending}; it died before it, or never built "
                                         "this communicator)")
            time.sleep(nap)
            nap = min(2 * nap, 0.004)
        return [pickle.loads(self.store.get(key + str(c.global_rank(p)))) if p != c.rank else obj
                for p in range(c.size)]

    def where(self) -> str:
        return f"the {self.what} (set-up round {self.round})"

    def _absent(self, peer: int, evidence: str | None):
        c = self.comm
        named, cause = attribute(c, peer, "waiting for", evidence, call=self.where())
        raise PeerError(f"rank {c.rank}: communicator set-up failed: rank {peer} did not arrive at {self.where()}."
                        + cause, dead=named, attributed=True)

    def _fallback(self, obj) -> list:
        """No store to rendezvous through (not expected with torch.distributed): the backend's gather."""
        out = [None] * self.comm.size
        dist.all_gather_object(out, obj, group=self.comm.group)
        return out


def arrive(comm, what: str = "communicator set-up") -> Rounds:
    """The arrival round every communicator's set-up starts with; returns its Rounds for more."""
    hello()
    rounds = Rounds(comm, what)
    rounds.gather(None)
    return rounds
