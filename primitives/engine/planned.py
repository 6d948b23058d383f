"""A planned call replayed in a handful of Python frames: primitives.all_reduce(t) -> Planned.run(t)
-> the textbook function (primitives/shm.py) + the ledger's record. MPI-4's MPI_Start on a
persistent request; CUDA graphs' replay.

    python -m benchmarks.call_latency --n 2 --sizes 4,4096 --reps 1 --no-yield
    torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --default --size 4K --iters 5000

core.Plan and core.Replay decide a signature once (algorithm, check, ledger record); a call that
replays them still runs api -> calls/ -> core.run -> the check -> shm_collectives -> the
textbook, ~130 Python calls. Once a signature's record is known, a call over this host's shared
memory (algorithm "shm", the default on one host) has nothing left to decide, and its Planned
holds what it runs with, bound:
    fn      the textbook function (shm_one_shot or shm_reduce_by_slices) and its op
    st      the segment as the textbook reads it (shm_collectives._State: flags, cached views)
    stamp   the check's envelope, packed once (shm_collectives.Stamp): it rides in the first
            workspace's header; every peer's header is compared with it (one bytes compare each),
            and only a difference decodes the headers into the error every rank raises
    rec     the ledger record to add (ledger.Ledger.add_replayed): no message counted
run(t) declines (the call takes the full path) when t is not a contiguous CPU tensor, an async
call is still queued on the communicator, or the ledger is inside another call or control traffic.
The cross-rank check, the fault attribution (comm.current_call names the call in a PeerError)
and strict mode are the full path's; set_handshake / set_strict_p2p / set_strict drop every
Planned (forget()). RINGZERO_PLANNED=0 builds none (every call takes the full path: to measure
what a Planned saves). Cost per call: 17 Python frames, 35 calls with the builtins (the full path:
129), and the textbook's torch ops (copy in, reduce out).
"""
from __future__ import annotations

import os
import weakref

import torch

from primitives import shm
from primitives.engine import shm_collectives
from primitives.engine.check import CallName
from primitives.engine.ledger import LEDGER, CallRecord

ENABLED = os.environ.get("RINGZERO_PLANNED", "1") != "0"
_TABLES: "weakref.WeakSet" = weakref.WeakSet()    # the communicators holding Planned calls
_STRIDED = torch.strided


class Planned:
    __slots__ = ("comm", "st", "fn", "op", "avg", "stamp", "rec", "name", "algo", "pending", "op_obj")

    def __init__(self, comm, st, fn, op: str, stamp, template: CallRecord, pending: dict, op_obj=None):
        self.comm, self.st, self.fn, self.op, self.avg = comm, st, fn, op, op == "avg"
        self.op_obj = op_obj          # the caller's op, kept alive: its id() is part of the key
        self.stamp, self.name, self.algo, self.pending = stamp, template.name, template.algorithm, pending
        self.rec = CallRecord(template.name, template.algorithm, template.nbytes, template.counts, template.links,
                              template)

    def run(self, t) -> bool:
        """Replay on t; False (nothing done) when the full path must run it."""
        comm, th = self.comm, LEDGER._t
        if (th.current is not None or th.control_depth or not t.is_cpu or t.layout is not _STRIDED
                or not t.is_contiguous() or self.pending.get(id(comm))):
            return False
        comm.calls = k = comm.calls + 1
        comm.current_call = CallName(self.name, self.algo, k)
        st = self.st
        st.fp, st.what = self.stamp, self.name
        try:
            self.fn(st, t if t.dim() == 1 else t.view(-1), self.op)
        finally:
            st.fp = None
        if self.avg:
            t.div_(comm.size)
        LEDGER.add_replayed(self.rec)
        return True


def table(comm) -> dict:
    """comm's Planned calls, keyed by (dtype, shape, id(op), algorithm, tag) as the API receives them
    (hashing a ReduceOp costs ~0.5 µs, its id ~50 ns; the Planned holds the op, so the id stays its)."""
    t = comm.__dict__.get("planned")
    if t is None:
        t = comm.planned = {}
        _TABLES.add(comm)
    return t


def forget() -> None:
    """Drop every Planned call (the check switch or strict mode changed: plans are re-decided)."""
    for c in list(_TABLES):
        c.__dict__.get("planned", {}).clear()


def all_reduce(comm, tensor, op, algorithm, tag, opn: str, stamp, template, pending) -> None:
    """Plan an all_reduce whose replay record is known (calls/all_reduce.py), over the segment."""
    if not ENABLED:
        return
    st = shm_collectives.state(comm)
    nbytes = tensor.numel() * tensor.element_size()
    fn = shm.shm_one_shot if shm_collectives.one_shot(nbytes, comm.size) else shm.shm_reduce_by_slices
    table(comm)[(tensor.dtype, tensor.shape, id(op), algorithm, tag)] = Planned(comm, st, fn, opn, stamp, template,
                                                                              pending, op)
