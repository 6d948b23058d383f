"""The checked call: what every drop-in collective (primitives/engine/calls/) runs around a
textbook algorithm. Argument checks (check.py) and the check round (envelope.py), the ledger,
async execution on one worker thread per communicator, and the choice algorithm="auto" makes.

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

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from primitives.comm import Work
from primitives.engine import inband, planned, shm_collectives
from primitives.engine.check import DTYPE_CODES, OP_CODES, CallName, Check, code
from primitives.engine.cost import choose
from primitives.engine.envelope import Fused, check_round, fits
from primitives.engine.errors import CollectiveError
from primitives.engine.ledger import LEDGER
from primitives.engine.subcomm import prefers_hierarchical

_HANDSHAKE = os.environ.get("RINGZERO_HANDSHAKE", "1") != "0"


def set_handshake(enabled: bool) -> None:
    global _HANDSHAKE
    _HANDSHAKE = bool(enabled)
    planned.forget()


def handshake_enabled() -> bool:
    return _HANDSHAKE


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
        if check.errors and (not _HANDSHAKE or comm.size == 1):
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


# what a small call runs when its data rides in the check's envelopes, and the payload per
# message as a function of S (the full buffer, nccl-tests' convention) and N
FUSED = {"all_reduce": ("one_shot", lambda S, n: S), "broadcast": ("linear", lambda S, n: S),
         "all_gather": ("direct", lambda S, n: S // n), "all_gather_single": ("direct", lambda S, n: S // n),
         "reduce_scatter": ("direct", lambda S, n: S // n), "reduce_scatter_single": ("direct", lambda S, n: S // n)}


def fuses(name: str, algo: str, comm, nbytes: int) -> bool:
    """Will this call's data ride in the check round's envelopes? (Same answer on every rank
    whose arguments agree; ranks whose arguments differ are stopped by the check itself.)"""
    f = FUSED.get(name)
    return (_HANDSHAKE and comm.size > 1 and f is not None and f[0] == algo and not inband.applies(comm, algo)
            and fits(f[1](nbytes, comm.size)))


class Plan:
    """What the first call of a signature decides, replayed by every later call with it (MPI-4's
    persistent collectives: MPI_Allreduce_init decides, MPI_Start replays; NCCL keeps plans per
    communicator). Kept in comm.plans, keyed by (call, algorithm asked for, S, check on, strict):
      algo   the algorithm that runs: "auto" resolved by the cost model once (~7 predictions)
      fused  whether the data rides in the check's envelopes (envelope.py)
      check  how the check travels (check_way): None (off), "shm", "inband" or "round"
    and, per fingerprint (call, algorithm, op, root, dtype, numel, shape, tag), the 8 ints the
    check sends (fingerprint(), cached the same way). A signature whose first call had bad
    arguments gets no plan: it is checked again next time."""
    __slots__ = ("algo", "fused", "check")

    def __init__(self, algo: str, fused: bool, check: str | None):
        self.algo, self.fused, self.check = algo, fused, check


class Replay:
    """A planned signature as its later calls replay it, kept in comm.plans by replay_key: the
    Plan, what the argument check derived (`args`: the op's name, the root, ...), and the ledger
    record its first replay counted (record), which every later replay adds without counting a
    message. Only a signature whose planning call passed the argument check gets one."""
    __slots__ = ("plan", "args", "record")

    def __init__(self, plan: Plan, args):
        self.plan, self.args, self.record = plan, args, None


PASSED = Check(None, "replayed")   # a replayed call's check: its signature passed when it was planned


def sig(t):
    """What a replayed call's tensor (or list of tensors) must share with the planned call's."""
    if isinstance(t, (list, tuple)):
        return tuple(map(sig, t))
    return (t.dtype, t.shape, t.device.type, t.layout) if isinstance(t, torch.Tensor) else type(t)


def replayed(comm, *key) -> tuple[Replay | None, tuple | None]:
    """(the Replay of this signature or None, its key; None when a part is unhashable). key: the
    call's name, sig() of its tensors, its other arguments; the check switch and strict mode added."""
    key = (*key, _HANDSHAKE, comm.strict)
    try:
        return comm.__dict__.get("plans", {}).get(key), key
    except TypeError:
        return None, None


def prepare(comm, name: str, algorithm, algos: dict, key: tuple, validate, size):
    """(replay, plan, check, ok, args, S): what a call runs with. A signature planned before (key:
    sig() of its tensors, its other arguments) replays its Replay, unchecked; else validate(check)
    -> (ok, what the check derived: the op's name, the root, ...) checks the arguments, and the
    first call of the signature builds its plan. size(args) -> S, asked only when ok. algorithm:
    the one asked for, or a function of args (reduce_scatter's uneven blocks take "direct")."""
    rp, k = replayed(comm, name, *key)
    if rp is not None:
        return rp, rp.plan, PASSED, True, rp.args, size(rp.args)
    check = Check(comm, name)
    ok, args = validate(check)
    ok = bool(ok) and not check.errors
    nbytes = size(args) if ok else 0
    pl = plan(name, algorithm(args) if callable(algorithm) else algorithm, algos, comm, nbytes, check)
    if k is not None and not check.errors:      # only a signature whose arguments passed
        comm.plans[k] = Replay(pl, args)
    return None, pl, check, ok, args, nbytes


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def check_way(comm, algo: str) -> str | None:
    """How a call's check travels: None (switched off, or a world of one); "shm": in the shared-memory
    workspace header; "inband": in the algorithm's first messages (inband.py); "round": envelopes
    of their own before the algorithm (envelope.py)."""
    if not (_HANDSHAKE and comm.size > 1):
        return None
    return "shm" if algo == "shm" else "inband" if inband.applies(comm, algo) else "round"


@functools.lru_cache(maxsize=4096)
def fingerprint(name, algorithm, op, root, dtype, numel, shape, tag) -> list[int]:
    return [code(name), code(algorithm), OP_CODES.get(op, -1), root, DTYPE_CODES.get(dtype, -1), numel,
            code(str(tuple(shape))), int(tag)]


def plan(name: str, algorithm: str, algos: dict, comm, nbytes: int, check: Check) -> Plan:
    """comm's plan for this signature, built by its first call (see Plan)."""
    plans = comm.__dict__.get("plans")
    if plans is None:
        plans = comm.plans = {}
    key = (name, algorithm, nbytes, _HANDSHAKE, getattr(comm, "strict", False))
    p = plans.get(key)
    if p is None:
        errors = len(check.errors)
        algo = _resolve(name, algorithm, algos, comm, nbytes, check)
        p = Plan(algo, fuses(name, algo, comm, nbytes), check_way(comm, algo))
        if len(check.errors) == errors:
            plans[key] = p
    return p


def _resolve(name: str, algorithm: str, algos: dict, comm, nbytes: int, check: Check) -> str:
    transport = getattr(comm, "transport", None)           # shm transport: auto may pick "shm"
    if algorithm == "auto":
        if "hierarchical" in algos and prefers_hierarchical(comm):
            return "hierarchical"
        if FUSED.get(name) and fuses(name, FUSED[name][0], comm, nbytes):
            return FUSED[name][0]            # the check round carries the data: one round in all
        return choose(name, comm.size, nbytes, comm.backend, transport)
    if algorithm == "shm" and "shm" in algos and transport != "shm":   # shm transport
        check.fail(f"argument 'algorithm' is 'shm', which needs every rank of the group on this host on the "
                   f"shared-memory transport; this communicator's transport is {transport or comm.backend!r}")
        return next(iter(algos))
    if algorithm not in algos:
        check.fail(f"argument 'algorithm' is {algorithm!r}; {name} accepts {['auto', *algos]}")
        return next(iter(algos))
    return algorithm
