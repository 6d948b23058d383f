"""The checked call: what every drop-in collective (primitives/engine/calls/) runs around a
textbook algorithm, as its plan says (planned.py: the algorithm "auto" picks, how the check
travels): the argument errors raised on every rank (check.py), the check, the ledger, and async
execution on one worker thread per communicator.

    python -m pytest -q -x tests/test_primitives_collectives.py

Callers can add their own `tag=` (an int every rank must agree on, e.g. which module a ZeRO-3
gather belongs to) and get that identity checked in the same round.

The check turns bad input into errors instead of hangs: every rank sends every other rank a
small envelope holding its call's fingerprint (call, algorithm, op, root, dtype, numel, shape
hash, tag, "my arguments are bad"); if any rank disagrees or flagged an error, *every* rank
raises, naming the rank and what differed. On CPU the envelopes ride with the algorithm's first
messages (primitives/engine/inband.py: no round of their own); on CUDA, in strict nccl
ordering and for algorithm="shm"/"hierarchical" they are a round before the algorithm, which
small calls' data rides in (primitives/engine/envelope.py). Switch the check off with
set_handshake(False) or RINGZERO_HANDSHAKE=0.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from primitives.comm import Work
from primitives.engine import inband, planned, shm_collectives
from primitives.engine.check import CallName, Check
from primitives.engine.envelope import Fused, check_round
from primitives.engine.errors import CollectiveError
from primitives.engine.ledger import LEDGER
from primitives.engine.planned import Plan, Replay, fingerprint, handshake_enabled, set_handshake  # noqa: F401

# ----------------------------------------------------------------------------- execution

_executors: dict[int, ThreadPoolExecutor] = {}
_pending: dict[int, list[Future]] = {}
_lock = threading.Lock()
_worker = threading.local()   # .key: the communicator whose worker this thread is


def run(comm, name: str, check: Check, plan: Plan, ok: bool, t, body, async_op: bool, tag: int, nbytes: int, *,
        op: str | None = None, root: int = -1, fused: Fused | None = None, replay: Replay | None = None,
        numel: int | None = None, shape: tuple | None = None):
    """Validate (locally and, via the check round, across ranks), then run body() under the ledger,
    now or (async_op) on comm's worker thread (_execute). The fingerprint describes tensor t (its
    numel, dtype and shape, or `numel` / `shape` given; nothing when the arguments are not `ok`);
    nbytes: S for the ledger. `fused`: how this call's data rides in the check's envelopes
    (primitives/engine/envelope.py) when the plan says it fits; then body() is not needed.
    `replay`: this call replays a planned signature (its ledger record, once known)."""
    algorithm = plan.algo
    if ok:
        numel, dtype = t.numel() if numel is None else numel, t.dtype
        shape = tuple(t.shape) if shape is None else shape
    else:
        numel, dtype, shape = -1, None, ()
    if fused is not None and not (ok and plan.fused and t.numel()):
        fused = None

    def go():
        comm.calls = getattr(comm, "calls", 0) + 1
        comm.current_call = CallName(name, algorithm, comm.calls)
        if check.errors and (not planned.HANDSHAKE or comm.size == 1):
            raise CollectiveError(f"rank {comm.rank}: {name}: " + "; ".join(check.errors))
        way = plan.check                 # decided once per signature (Plan)
        template = replay.record if replay is not None else None
        rec, prev = LEDGER.open_call(name, algorithm, nbytes, template)  # no `with`: a generator costs µs
        ok = False
        try:
            checked(way)
            ok = True
        finally:
            LEDGER.close_call(rec, prev, ok)
        if replay is not None and template is None and not LEDGER.in_control():
            replay.record = rec           # the first replay counts its messages; the later ones add it

    def checked(way):
        if way is None:
            return body()
        meta = fingerprint(name, algorithm, op, root, dtype, numel, tuple(shape), tag)
        if way == "shm":              # the check rides in the shm workspace header: no round
            return shm_collectives.checked(comm, name, meta, check.errors, body)
        if way == "inband":           # the check rides in the data (inband.py)
            ib = comm._inband = inband.InBand(comm, name, meta, check.errors)
            try:
                if not check.errors:
                    body()
                ib.finish()
            finally:
                comm._inband = None
            return
        if check_round(comm, name, meta, check.errors, fused):
            return
        body()

    return _execute(comm, go, async_op, name)


def submit(comm, fn, name: str = "call") -> Work:
    """Run fn() on comm's worker thread, in call order with its async collectives (the one
    executor for asynchronous communication); returns its Work."""
    return _execute(comm, fn, True, name)


def _execute(comm, go, async_op: bool, name: str):
    """Collectives on one communicator run in call order on a single worker thread when any of
    them is asynchronous, so point-to-point messages of different calls can never interleave."""
    key = id(comm)
    if getattr(_worker, "key", None) == key:
        # fn of submit() running a collective on its own communicator: it is in call order
        # already, and queueing it behind fn would wait for itself
        go()
        return Work(comm, None, None, name) if async_op else None
    if not async_op and not _pending.get(key):     # nothing queued (the common case): here, no lock
        go()
        return None
    with _lock:
        pend = _pending.get(key)
        if pend:
            pend = _pending[key] = [f for f in pend if not f.done()]
        if not async_op and not pend:
            ex = None
        else:
            ex = _executors.get(key)
            if ex is None:
                ex = _executors[key] = ThreadPoolExecutor(1, f"ringzero-{name}", _mark, (key,))
            fut = ex.submit(go)
            _pending.setdefault(key, []).append(fut)
    if ex is None:
        go()
        return None
    if async_op:
        return Work(comm, fut, None, name)
    fut.result()
    return None


def _mark(key: int) -> None:
    _worker.key = key


def drain() -> None:
    """Wait for outstanding async collectives and stop their worker threads."""
    with _lock:
        ex, _ = list(_executors.values()), _executors.clear()
        _pending.clear()
    for e in ex:
        e.shutdown(wait=True)


# ----------------------------------------------------------------------------- helpers

def flat_work(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous 1-D view of t, or a contiguous copy when t is not contiguous."""
    if t.is_contiguous():
        return (t if t.dim() == 1 else t.view(-1)), False
    return t.contiguous().view(-1), True


class LazyFlat:
    """A collective's tensor as a contiguous 1-D buffer, made when the call executes (async calls
    run later than they are posted); copy_back() writes it into the caller's tensor if it had
    to be a copy."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self._buf, self._copied = tensor, None, False

    def __call__(self) -> torch.Tensor:
        if self._buf is None:
            self._buf, self._copied = flat_work(self.tensor)
        return self._buf

    def copy_back(self) -> None:
        if self._copied:
            self.tensor.copy_(self._buf.view_as(self.tensor))
