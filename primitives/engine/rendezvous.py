"""Communicator set-up through the store: one key per rank per round, and a deadline, so a rank
that never arrives is named (who, and the evidence), never a bare "set-up failed".

    rounds = Rounds(comm, "shared-memory rendezvous")   # once per communicator built (shm.py)
    info = rounds.gather(obj)                            # every rank's obj, by group rank

Every communicator's set-up goes through it: the arrival round of every transport (TCP, nccl,
shared memory), then the shared-memory rendezvous's own rounds (shm_segment.rendezvous). A
backend all_gather_object would fail with "Connection closed by peer" and no rank in it, or wait
for a rank that is gone; here each rank writes

    ringzero/setup/<group name>.<n-th build>/<round>/<global rank> = pickle(obj)

X. While it waits it checks each missing
peer: its process gone (faults.gone: a hello on this host whose pid no longer exists), or a
failure report from it (it saw another rank die and gave up: the chain leads to the dead one).
At the deadline (the communicator's timeout) the ranks still missing are named as never arrived.
Cost per round: 1 store write + (N-1) reads per rank; nothing travels on the data path.
"""
from __future__ import annotations

import pickle
import time
from collections import Counter

import torch.distributed as dist

from primitives.engine import faults
from primitives.engine.errors import PeerError

_BUILDS: Counter = Counter()    # group name -> communicators built for it in this process


class Rounds:
    """The set-up rounds of one communicator (every rank of its group builds it in the same order)."""

    def __init__(self, comm, what: str):
        self.comm, self.what, self.round = comm, what, 0
        name = getattr(comm.group, "group_name", None) or "world"
        _BUILDS[name] += 1
        self.tag = f"ringzero/setup/{name}.{_BUILDS[name]}"
        self.store, _ = faults.store()
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
                ev = faults.gone(self.store, c.global_rank(p))
                rep = faults.report_of(self.store, c.global_rank(p))
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
        named, cause = faults.attribute(c, peer, "waiting for", evidence, call=self.where())
        raise PeerError(f"rank {c.rank}: communicator set-up failed: rank {peer} did not arrive at {self.where()}."
                        + cause, dead=named, attributed=True)

    def _fallback(self, obj) -> list:
        """No store to rendezvous through (not expected with torch.distributed): the backend's gather."""
        out = [None] * self.comm.size
        dist.all_gather_object(out, obj, group=self.comm.group)
        return out


def arrive(comm, what: str = "communicator set-up") -> Rounds:
    """The arrival round every communicator's set-up starts with; returns its Rounds for more."""
    faults.hello()
    rounds = Rounds(comm, what)
    rounds.gather(None)
    return rounds
