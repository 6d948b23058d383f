"""Plans: what the first call of a signature decides, and the later calls replay (MPI-4's
persistent collectives: MPI_Allreduce_init decides, MPI_Start replays; NCCL's per-communicator
plans; CUDA graphs).

    python -m benchmarks.call_latency --n 2 --sizes 4,4096 --reps 1 --no-yield
    torchrun --standalone --nproc_per_node 2 benchmarks/shm_profile.py --default --size 4K --iters 5000

prepare() gives every checked call (calls/) its Plan (the algorithm, "auto" resolved by the cost
model once; whether the data rides in the check's envelopes; how the check travels) and, once
the arguments passed, a Replay: later calls of the signature skip the argument check. A replay
still runs api -> calls/ -> core.run -> the check -> shm_collectives -> the textbook, ~130
Python calls. Once a signature's ledger record is known, an all_reduce over this host's shared
memory (algorithm "shm", the default on one host) has nothing left to decide, and its Planned
holds what it runs with, bound:
    fn      the textbook function (shm_one_shot or shm_reduce_by_slices) and its op
    st      the segment as the textbook reads it (shm_collectives._State: flags, cached views)
    stamp   the check's envelope, packed once (shm_collectives.Stamp): it rides in the first
            workspace's header; every peer's header is compared with it (one bytes compare each),
            and only a difference decodes the headers into the error every rank raises
    rec     the ledger record to add (ledger.Ledger.add_replayed): no message counted
so primitives.all_reduce(t) -> Planned.run(t) -> the textbook function + the ledger's record.
run(t) declines (the call takes the full path) when t is not a contiguous CPU tensor, an async
call is still queued on the communicator, or the ledger is inside another call or control traffic.
The cross-rank check, the fault attribution (comm.current_call names the call in a PeerError)
and strict mode are the full path's; set_strict_p2p / set_strict drop every Planned (forget()),
set_handshake keeps one table per setting. RINGZERO_PLANNED=0 builds none (every call takes
the full path: to measure what a Planned saves). Cost per call: 17 Python frames, 35 calls with
the builtins (the full path: 129), and the textbook's torch ops (copy in, reduce out): N of them,
~1-2 µs each. A call of at most ITEMS float32 / float64 (sum, avg, product) runs none: shm_one_shot
takes the tensor's memoryview (kept from the last call with the same tensor) and copies and reduces
item by item (~0.1 µs an op; the same bits), autograd told of the write (increment_version).
"""
from __future__ import annotations

import functools
import os
import weakref

import torch

from primitives import shm
from primitives.engine import inband, shm_collectives
from primitives.engine.check import DTYPE_CODES, OP_CODES, CallName, Check, code
from primitives.engine.cost import choose
from primitives.engine.envelope import fits
from primitives.engine.ledger import LEDGER, CallRecord
from primitives.engine.topology import prefers_hierarchical

ENABLED = os.environ.get("RINGZERO_PLANNED", "1") != "0"
_TABLES: "weakref.WeakSet" = weakref.WeakSet()    # the communicators holding Planned calls
_STRIDED = torch.strided
# A replayed all_reduce of at most ITEMS floats runs shm_one_shot on their memoryview, item by item: ~0.1 µs
# an op where a torch op costs ~1-2 µs (benchmarks/shm_profile.py --items). RINGZERO_SHM_ITEMS=0: never.
ITEMS = int(os.environ.get("RINGZERO_SHM_ITEMS", 8))
_ITEM_FORMATS = {torch.float32: "f", torch.float64: "d"}
_bump = torch._C._increment_version     # what torch.autograd.graph.increment_version calls (~0.2 µs less)


HANDSHAKE = os.environ.get("RINGZERO_HANDSHAKE", "1") != "0"     # the check on (core.run)


def set_handshake(enabled: bool) -> None:
    """The check on or off. Each setting keeps its own Planned calls (table()), so switching back
    and forth, as a benchmark interleaving the two does, replays them instead of planning again."""
    global HANDSHAKE
    HANDSHAKE = bool(enabled)
    for c in list(_TABLES):
        c.planned = c._planned_by[HANDSHAKE]


def handshake_enabled() -> bool:
    return HANDSHAKE


# what a small call runs when its data rides in the check's envelopes, and the payload per
# message as a function of S (the full buffer, nccl-tests' convention) and N
FUSED = {"all_reduce": ("one_shot", lambda S, n: S), "broadcast": ("linear", lambda S, n: S),
         "all_gather": ("direct", lambda S, n: S // n), "all_gather_single": ("direct", lambda S, n: S // n),
         "reduce_scatter": ("direct", lambda S, n: S // n), "reduce_scatter_single": ("direct", lambda S, n: S // n)}


def fuses(name: str, algo: str, comm, nbytes: int) -> bool:
    """Will this call's data ride in the check round's envelopes? (Same answer on every rank
    whose arguments agree; ranks whose arguments differ are stopped by the check itself.)"""
    f = FUSED.get(name)
    return (HANDSHAKE and comm.size > 1 and f is not None and f[0] == algo and not inband.applies(comm, algo)
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
    key = (*key, HANDSHAKE, comm.strict)
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
    if not (HANDSHAKE and comm.size > 1):
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
    key = (name, algorithm, nbytes, HANDSHAKE, getattr(comm, "strict", False))
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


# ----------------------------------------------------------------------------- planned calls

class Planned:
    __slots__ = ("comm", "st", "fn", "op", "avg", "stamp", "rec", "name", "algo", "pending", "op_obj", "items",
                 "t", "ptr", "mv", "cid")

    def __init__(self, comm, st, fn, op: str, stamp, template: CallRecord, pending: dict, op_obj=None, items=None):
        self.comm, self.st, self.fn, self.op, self.avg = comm, st, fn, op, op == "avg"
        self.op_obj = op_obj          # the caller's op, kept alive: its id() is part of the key
        self.stamp, self.name, self.algo, self.pending = stamp, template.name, template.algorithm, pending
        self.rec = CallRecord(template.name, template.algorithm, template.nbytes, template.counts, template.links,
                              template)
        self.items, self.t, self.ptr, self.mv, self.cid = items, None, 0, None, id(comm)

    def run(self, t) -> bool:
        """Replay on t; False (nothing done) when the full path must run it."""
        comm, th = self.comm, LEDGER._t
        if (th.current is not None or th.control_depth or not t.is_cpu or t.layout is not _STRIDED
                or not t.is_contiguous() or self.pending.get(self.cid)):
            return False
        buf = None
        if self.items and not t.requires_grad:       # a few floats: their memoryview (shm_one_shot, item by item)
            buf = self.mv if t is self.t and t.data_ptr() == self.ptr else self._items(t)
        if buf is None:
            buf = t if t.dim() == 1 else t.view(-1)
        comm.calls = k = comm.calls + 1
        comm.current_call = CallName(self.name, self.algo, k)
        st = self.st
        st.fp, st.what = self.stamp, self.name
        try:
            self.fn(st, buf, self.op)
        finally:
            st.fp = None
        if buf.__class__ is memoryview:
            _bump((t,))                               # written behind torch's back: autograd sees it (in place)
            if self.avg:
                n = comm.size
                for i in range(len(buf)):
                    buf[i] = buf[i] / n               # the bits of t.div_(n) (float32: exact in double, rounded once)
        elif self.avg:
            t.div_(comm.size)
        LEDGER.add_replayed(self.rec)
        return True

    def _items(self, t):
        """t's items as a memoryview (None where numpy cannot view t: it takes the tensor path), kept
        for the next call with t when t's storage is no bigger: holding t then holds nothing more."""
        if type(t) is not torch.Tensor:
            return None
        try:
            mv = memoryview(t.numpy()).cast("B").cast(self.items)
        except (RuntimeError, TypeError, ValueError):
            return None
        if t.untyped_storage().nbytes() <= 8 * ITEMS:
            self.t, self.ptr, self.mv = t, t.data_ptr(), mv
        return mv


def table(comm) -> dict:
    """comm's Planned calls, keyed by (dtype, shape, id(op), algorithm, tag) as the API receives them
    (hashing a ReduceOp costs ~0.5 µs, its id ~50 ns; the Planned holds the op, so the id stays its)."""
    t = comm.__dict__.get("planned")
    if t is None:
        comm._planned_by = {True: {}, False: {}}          # one table per check setting
        t = comm.planned = comm._planned_by[HANDSHAKE]
        _TABLES.add(comm)
    return t


def forget() -> None:
    """Drop every Planned call (strict mode's default changed; set_strict drops one communicator's)."""
    for c in list(_TABLES):
        for t in c.__dict__.get("_planned_by", {}).values():
            t.clear()


def all_reduce(comm, tensor, op, algorithm, tag, opn: str, stamp, template, pending) -> None:
    """Plan an all_reduce whose replay record is known (calls/all_reduce.py), over the segment."""
    if not ENABLED:
        return
    st = shm_collectives.state(comm)
    nbytes = tensor.numel() * tensor.element_size()
    fn = shm.shm_one_shot if shm_collectives.one_shot(nbytes, comm.size) else shm.shm_reduce_by_slices
    items = (_ITEM_FORMATS.get(tensor.dtype) if fn is shm.shm_one_shot and opn in shm.ITEM_OPS
             and 0 < tensor.numel() <= ITEMS else None)
    table(comm)[(tensor.dtype, tensor.shape, id(op), algorithm, tag)] = Planned(comm, st, fn, opn, stamp, template,
                                                                              pending, op, items)
