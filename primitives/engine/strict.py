"""Strict point-to-point: nccl's ordering rules replayed over gloo, so a test on a CPU-only
machine catches a pattern that would deadlock on GPUs.

    RINGZERO_STRICT_P2P=1 python -m pytest -q tests/test_strict_p2p.py
    primitives.set_strict_p2p(True)        (every communicator)   comm.set_strict(True)   (one)

The rules, from torch's ProcessGroupNCCL::pointToPoint and the NCCL docs:
  * an ungrouped send/recv runs on the communicator (and stream) of the pair {me, peer}
    (getKeySendRecv), in posting order: it starts only when every earlier operation to
    that peer has finished;
  * a send finishes only when the peer's matching receive runs, and vice versa (we model
    every message as a rendezvous, the conservative reading of "ncclSend needs ncclRecv");
  * a group (batch_isend_irecv) runs on the device's communicator as one fused launch: its
    operations progress together, and groups run one after another.
Operations are handed to gloo only once these rules let them start; tag 0 carries pair streams
and tag 1 groups, since those are different nccl communicators and never match each other.
A helper thread per started operation waits on it and then starts its successor, as a GPU
stream would, so nothing depends on which request the host happens to wait on.

Deadlock detection: when the host has waited `probe` seconds, this rank publishes the head of
each pair stream in the process group's store and reads the peer's. If my stream to P is stuck
on an operation whose match P has not run, and P's stream to me is stuck on one whose match I
have not started, neither can ever move: StrictOrderError names both ranks, both operations and
the collective call, within about two probes. Any other stall ends as the usual PeerError at
the communicator's deadline. Cost: a thread per message. For tests, never for speed.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict, deque
from datetime import timedelta

import torch.distributed as dist

from primitives.comm import Work
from primitives.engine.errors import PeerError

_ENABLED = os.environ.get("RINGZERO_STRICT_P2P", "0") not in ("", "0")


def enabled() -> bool:
    return _ENABLED


def set_strict_p2p(flag: bool) -> None:
    """Process default for every communicator that has not called set_strict()."""
    global _ENABLED
    _ENABLED = bool(flag)
    from primitives.engine import planned      # plans depend on it: re-decided (no import cycle at load)
    planned.forget()


class StrictOrderError(PeerError):
    """Under nccl's ordering rules these point-to-point operations can never complete."""


_OPP = {"send": "recv", "recv": "send"}


class Op:
    __slots__ = ("kind", "tensor", "peer", "grouped", "index", "label", "done", "error", "handle")

    def __init__(self, kind, tensor, peer, grouped, index, label):
        self.kind, self.tensor, self.peer, self.grouped = kind, tensor, peer, grouped
        self.index, self.label = index, label
        self.done, self.error, self.handle = False, None, None


def describe(kind: str, index: int, peer: int, grouped: bool = False) -> str:
    what = f"irecv #{index} from rank {peer}" if kind == "recv" else f"isend #{index} to rank {peer}"
    return what + (" (grouped)" if grouped else "")


class _Posted:
    """A strict-mode operation as a Work's handle: the scheduler waits for it."""
    waits_itself = True

    def __init__(self, sched: "Scheduler", op: Op):
        self.sched, self.op = sched, op

    def wait(self) -> None:
        self.sched.wait(self.op)

    def is_completed(self) -> bool:
        return self.op.done


class Scheduler:
    """Per-communicator simulated nccl streams: one FIFO per peer, one for groups."""

    def __init__(self, comm, probe: float = 0.5):
        if comm.backend != "gloo" or not hasattr(comm, "group"):
            raise ValueError(f"rank {comm.rank}: strict point-to-point mode simulates nccl over gloo; "
                             f"this communicator's backend is {comm.backend}")
        self.comm, self.probe = comm, probe
        self.cv = threading.Condition()
        self.streams: dict[int, deque] = defaultdict(deque)
        self.groups: deque = deque()
        self.seq: dict = defaultdict(int)     # (peer, kind, grouped) -> next index
        self.ndone: dict = defaultdict(int)   # (peer, kind, grouped) -> finished count
        gid = ",".join(str(comm.global_rank(r)) for r in range(comm.size))
        self.key = lambda r: f"ringzero/strict/{gid}/{r}"  # noqa: E731
        self.verdict_key = f"ringzero/strict/{gid}/deadlock"

    # ---------------------------------------------------------------- posting and progress
    def post(self, ops, grouped: bool) -> list:
        label = str(getattr(self.comm, "current_call", "") or "point-to-point")
        with self.cv:
            made = []
            for kind, t, p in ops:
                k = (p, kind, grouped)
                made.append(Op(kind, t, p, grouped, self.seq[k], label))
                self.seq[k] += 1
            if grouped:
                self.groups.append(made)
                if len(self.groups) == 1:
                    for op in made:
                        self._start(op)
            else:
                q = self.streams[made[0].peer]
                q.append(made[0])
                if len(q) == 1:
                    self._start(made[0])
        return [Work(self.comm, _Posted(self, op), op.peer, "receiving from" if op.kind == "recv" else "sending to")
                for op in made]

    def _start(self, op: Op) -> None:              # lock held
        # Always the process group's own transport (gloo over TCP), never ShmComm's shared-memory
        # channels: strict mode simulates nccl's streams, and gloo's isend/irecv are a true
        # rendezvous-per-message transport the rules above were built on, whereas shm's sends are
        # buffered and move only inside wait(). So a ShmComm in strict mode sends over gloo.
        fn = dist.irecv if op.kind == "recv" else dist.isend
        try:
            op.handle = fn(op.tensor, self.comm.global_rank(op.peer), group=self.comm.group,
                           tag=1 if op.grouped else 0)
        except Exception as e:
            op.error = e
            self._finish(op)
            return
        threading.Thread(target=self._watch, args=(op,), daemon=True, name="ringzero-strict").start()

    def _watch(self, op: Op) -> None:
        try:
            op.handle.wait(timeout=timedelta(seconds=self.comm.timeout))
        except Exception as e:
            op.error = e
        with self.cv:
            self._finish(op)

    def _finish(self, op: Op) -> None:             # lock held
        op.done = True
        self.ndone[(op.peer, op.kind, op.grouped)] += 1
        if op.grouped:
            if self.groups and all(o.done for o in self.groups[0]):
                self.groups.popleft()
                for nxt in (self.groups[0] if self.groups else []):
                    self._start(nxt)
        else:
            q = self.streams[op.peer]
            q.popleft()
            if q:
                self._start(q[0])
        self.cv.notify_all()

    # ---------------------------------------------------------------- waiting and detection
    def wait(self, op: Op) -> None:
        c = self.comm
        start = time.monotonic()
        deadline, next_probe = start + c.timeout, start + self.probe
        while True:
            with self.cv:
                if not op.done:
                    self.cv.wait(timeout=max(0.0, min(next_probe, deadline) - time.monotonic()))
                if op.done:
                    break
                state = self._state()
            now = time.monotonic()
            self._raise_if_reported()
            if now >= deadline:
                raise PeerError(str(c._peer_error(op.peer, "receiving from" if op.kind == "recv" else "sending to"))
                                + f" [strict mode, waiting for {describe(op.kind, op.index, op.peer, op.grouped)}"
                                f" in {op.label}; my stream heads: {state['heads']}]")
            if now >= next_probe:
                self._probe(state, op.label)
                next_probe = now + self.probe
        if op.error is not None:
            self._raise_if_reported()
            raise c._peer_error(op.peer, "receiving from" if op.kind == "recv" else "sending to", op.error)

    def _raise_if_reported(self) -> None:
        """A peer found the deadlock first (and may have exited, failing my gloo ops): say so."""
        store = dist.distributed_c10d._get_default_store()
        if store.check([self.verdict_key]):
            raise StrictOrderError(f"rank {self.comm.rank}: stopped because a peer found a point-to-point "
                                   f"deadlock: {store.get(self.verdict_key).decode()}")

    def _state(self) -> dict:                      # lock held
        heads = {p: [q[0].kind, q[0].index, q[0].label] for p, q in self.streams.items() if q}
        done = {p: {k: self.ndone[(p, k, False)] for k in ("send", "recv")} for p in range(self.comm.size)}
        return {"heads": heads, "done": done, "t": time.time()}

    def _probe(self, state: dict, label: str) -> None:
        store = dist.distributed_c10d._get_default_store()
        me = self.comm.rank
        store.set(self.key(me), json.dumps(state))
        for p, (kind, idx, my_label) in state["heads"].items():
            if not store.check([self.key(p)]):
                continue
            theirs = json.loads(store.get(self.key(p)).decode())
            head = theirs["heads"].get(str(me))
            if head is None:
                continue                          # the peer has not posted to me yet: no verdict
            pk, pidx, plabel = head
            if theirs["done"][str(me)][_OPP[kind]] > idx or (pk, pidx) == (_OPP[kind], idx):
                continue                          # my head's match ran, or is running: it will finish
            if state["done"][p][_OPP[pk]] > pidx:
                continue                          # the peer's snapshot is stale
            msg = (
                f"rank {me}: strict point-to-point (nccl ordering) found a deadlock with rank {p} in "
                f"{my_label}: rank {me}'s stream to rank {p} is stuck on {describe(kind, idx, p)}, whose match "
                f"({describe(_OPP[kind], idx, me)} on rank {p}) waits behind rank {p}'s "
                f"{describe(pk, pidx, me)} ({plabel}), which needs rank {me}'s "
                f"{describe(_OPP[pk], pidx, p)}, queued behind the first. On nccl this hangs forever: post "
                f"sends and receives between the two ranks as one group (comm.exchange / dist.batch_isend_irecv).")
            store.set(self.verdict_key, msg)
            raise StrictOrderError(msg)
