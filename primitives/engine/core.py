"""What every collective shares: argument checks, the call check (envelope.py), reduce ops,
chunking, scratch buffers, async execution and algorithm selection.

Callers can add their own `tag=` (an int every rank must agree on, e.g. which module a ZeRO-3
gather belongs to) and get that identity checked in the same round.

The check turns bad input into errors instead of hangs: every call opens with one round in
which every rank sends every other rank a fixed-size envelope holding its call's fingerprint
(call, algorithm, op, root, dtype, numel, shape hash, tag, "my arguments are bad"). If any rank
disagrees or flagged an error, *every* rank raises, naming the rank and what differed. Small
calls carry their data in the same envelopes, so for them the check costs no extra round
(primitives/engine/envelope.py). Switch it off with set_handshake(False) or RINGZERO_HANDSHAKE=0.
"""
from __future__ import annotations

import functools
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from primitives.algos import ALGORITHMS, PIPELINE_BYTES, chunk_bounds, group_rank, segments
from primitives.comm import Communicator, get_comm
from primitives.engine.cost import choose
from primitives.engine.envelope import Fused, check_round, fits
from primitives.engine.ledger import LEDGER

ReduceOp = dist.ReduceOp
_HANDSHAKE = os.environ.get("RINGZERO_HANDSHAKE", "1") != "0"


def set_handshake(enabled: bool) -> None:
    global _HANDSHAKE
    _HANDSHAKE = bool(enabled)


def handshake_enabled() -> bool:
    return _HANDSHAKE


class CollectiveError(ValueError):
    """Bad arguments to a collective; raised on every rank of the call."""


# ----------------------------------------------------------------------------- reduce ops

_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min",
        ReduceOp.MAX: "max", ReduceOp.AVG: "avg"}
_OP_CODES = {n: i for i, n in enumerate(("sum", "product", "min", "max", "avg"))}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool)
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}


def op_name(op) -> str | None:
    if isinstance(op, str):
        return op.lower() if op.lower() in _OP_CODES else None
    for k, v in _OPS.items():
        try:
            if op == k:
                return v
        except Exception:
            pass
    return None


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """acc <- acc (op) other, in place. AVG is summed here and divided once at the end."""
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "product":
        acc.mul_(other)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:
        torch.maximum(acc, other, out=acc)


def finish_avg_(t: torch.Tensor, op: str, n: int) -> None:
    if op == "avg" and n > 1:
        t.div_(n)


# ----------------------------------------------------------------------------- argument checks

class Check:
    """Collects this rank's argument errors; raise_if_any() raises them on every rank."""

    def __init__(self, comm: Communicator, name: str):
        self.comm, self.name, self.errors = comm, name, []

    def fail(self, msg: str) -> None:
        self.errors.append(msg)

    def tensor(self, arg: str, t) -> bool:
        if not isinstance(t, torch.Tensor):
            self.fail(f"argument {arg!r} must be a torch.Tensor, got {type(t).__name__}")
            return False
        if t.dtype not in _DTYPE_CODES:
            self.fail(f"argument {arg!r} has dtype {t.dtype}; supported: {[str(d) for d in _DTYPES]}")
            return False
        if t.device.type != self.comm.device.type:
            self.fail(f"argument {arg!r} is on {t.device} but backend {self.comm.backend} "
                      f"needs {self.comm.device.type} tensors")
            return False
        return True

    def op(self, op, dtype) -> str:
        name = op_name(op)
        if name is None:
            self.fail(f"argument 'op' is {op!r}; expected torch.distributed.ReduceOp SUM, PRODUCT, MIN, MAX or AVG")
            return "sum"
        if name == "avg" and (dtype is None or not dtype.is_floating_point):
            self.fail(f"argument 'op' is AVG but the tensor dtype is {dtype}; AVG needs a floating dtype")
        if dtype == torch.bool and name in ("sum", "product", "avg"):
            self.fail(f"argument 'op' is {name.upper()}, not defined for torch.bool; use MIN or MAX")
        return name

    def rank(self, arg: str, value) -> int:
        n = self.comm.size
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(f"argument {arg!r} must be an int rank, got {value!r}")
            return 0
        try:
            g = group_rank(self.comm, value)
        except Exception:
            g = -1
        if not 0 <= g < n:
            self.fail(f"argument {arg!r} = {value} is not a rank of this group "
                      f"(expected a global rank among {[self.comm.global_rank(r) for r in range(n)]})")
            return 0
        return g

    def tensor_list(self, arg: str, lst, like: torch.Tensor) -> bool:
        n = self.comm.size
        if not isinstance(lst, (list, tuple)) or len(lst) != n:
            got = f"length {len(lst)}" if isinstance(lst, (list, tuple)) else type(lst).__name__
            self.fail(f"argument {arg!r} must be a list of {n} tensors (one per rank), got {got}")
            return False
        for i, t in enumerate(lst):
            if not self.tensor(f"{arg}[{i}]", t):
                return False
            if t.dtype != like.dtype or t.numel() != like.numel():
                self.fail(f"argument {arg}[{i}] has dtype {t.dtype} and {t.numel()} elements; expected "
                          f"{like.dtype} and {like.numel()} elements like the tensor argument")
                return False
        return True

    def sizes(self, what: str, got: int, expected: int) -> None:
        if got != expected:
            self.fail(f"{what}: got {got} elements, expected {expected}")


# ----------------------------------------------------------------------------- the check

@functools.lru_cache(maxsize=4096)     # names and shapes repeat every step: hash each once
def _code(s: str) -> int:
    return zlib.crc32(s.encode()) & 0x7FFFFFFF


def _meta_desc(names):
    def desc(row):  # noqa: E306
        known = {_code(s): s for s in [*ALGORITHMS, *(a for v in ALGORITHMS.values() for a in v)]}
        d = dict(zip(names, row))
        dtype = _DTYPES[d["dtype"]] if 0 <= d["dtype"] < len(_DTYPES) else "?"
        return (f"(call={known.get(d['call'], '?')}, algorithm={known.get(d['algorithm'], '?')}, dtype={dtype}, "
                f"numel={d['numel']}, shape#={d['shape']}, tag={d['tag']}, "
                f"op={list(_OP_CODES)[d['op']] if d['op'] >= 0 else '-'}, root={d['root']})")
    return desc


_META_DESC = _meta_desc(["call", "algorithm", "op", "root", "dtype", "numel", "shape", "tag"])


class _CallName:
    """'all_reduce(algorithm=ring) call #7', formatted only when an error message needs it."""
    __slots__ = ("name", "algorithm", "k")

    def __init__(self, name, algorithm, k):
        self.name, self.algorithm, self.k = name, algorithm, k

    def __str__(self):
        return f"{self.name}(algorithm={self.algorithm}) call #{self.k}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731

    def __bool__(self):
        return True


# ----------------------------------------------------------------------------- execution

_executors: dict[int, ThreadPoolExecutor] = {}
_pending: dict[int, list[Future]] = {}
_lock = threading.Lock()


class AsyncWork:
    """What async_op=True returns: wait() blocks until the collective finished (re-raising its error)."""

    def __init__(self, fut: Future):
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.result()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()


def run(comm: Communicator, name: str, algorithm: str, check: Check, *, numel: int, dtype,
        op: str | None, root: int, shape: tuple, nbytes: int, body, async_op: bool = False, tag: int = 0,
        fused: Fused | None = None):
    """Validate (locally and, via the check round, across ranks), then run body() under the ledger.
    `fused`: how this call's data rides in the check's envelopes (primitives/engine/envelope.py) when
    it is small enough; then body() is not needed.

    Collectives on one communicator run in call order on a single worker thread when any of
    them is asynchronous, so point-to-point messages of different calls can never interleave.
    """
    def go():
        comm.calls = getattr(comm, "calls", 0) + 1
        comm.current_call = _CallName(name, algorithm, comm.calls)
        if check.errors and (not _HANDSHAKE or comm.size == 1):
            raise CollectiveError(f"rank {comm.rank}: {name}: " + "; ".join(check.errors))
        with LEDGER.call(name, algorithm, nbytes):
            if _HANDSHAKE and comm.size > 1:
                meta = [_code(name), _code(algorithm), _OP_CODES.get(op, -1), root,
                        _DTYPE_CODES.get(dtype, -1), numel, _code(str(tuple(shape))), int(tag)]
                if check_round(comm, name, meta, check.errors, _META_DESC, fused, CollectiveError):
                    return
            body()

    key = id(comm)
    with _lock:
        pend = [f for f in _pending.get(key, []) if not f.done()]
        _pending[key] = pend
        if not async_op and not pend:
            ex = None
        else:
            ex = _executors.get(key)
            if ex is None:
                ex = _executors[key] = ThreadPoolExecutor(1, thread_name_prefix=f"ringzero-{name}")
            fut = ex.submit(go)
            pend.append(fut)
    if ex is None:
        go()
        return None
    if async_op:
        return AsyncWork(fut)
    fut.result()
    return None


def drain() -> None:
    """Wait for outstanding async collectives and stop their worker threads."""
    with _lock:
        ex, _ = list(_executors.values()), _executors.clear()
        _pending.clear()
    for e in ex:
        e.shutdown(wait=True)


# ----------------------------------------------------------------------------- helpers

def pipeline_segments(buf: torch.Tensor) -> int:
    """k = ceil(S / 1 MiB) segments (at least 1, at most one per element)."""
    return segments(buf.numel(), buf.element_size())


def scratch(comm: Communicator, numel: int, dtype, slot=0, device=None) -> torch.Tensor:
    """A reusable buffer per (device, dtype, slot), owned by the communicator: allocated once and
    grown, never freed mid-run. Per communicator, so collectives running concurrently on two
    communicators (async work on different groups) never share one; one communicator's calls
    run one at a time (see run), so its buffers need no lock."""
    cache = comm.__dict__.setdefault("_scratch", {})
    device = comm.device if device is None else torch.device(device)
    key = (device, dtype, slot)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf[:numel]


def flat_work(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous 1-D view of t, or a contiguous copy when t is not contiguous."""
    if t.is_contiguous():
        return t.view(-1), False
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


def wait_all(reqs) -> None:
    for r in reqs:
        r.wait()


# what a small call runs when its data rides in the check's envelopes, and the payload per
# message as a function of S (the full buffer, nccl-tests' convention) and N
FUSED = {"all_reduce": ("one_shot", lambda S, n: S), "broadcast": ("linear", lambda S, n: S),
         "all_gather": ("direct", lambda S, n: S // n), "all_gather_single": ("direct", lambda S, n: S // n),
         "reduce_scatter": ("direct", lambda S, n: S // n), "reduce_scatter_single": ("direct", lambda S, n: S // n)}


def fuses(name: str, algo: str, comm: Communicator, nbytes: int) -> bool:
    """Will this call's data ride in the check round's envelopes? (Same answer on every rank
    whose arguments agree; ranks whose arguments differ are stopped by the check itself.)"""
    f = FUSED.get(name)
    return _HANDSHAKE and comm.size > 1 and f is not None and f[0] == algo and fits(f[1](nbytes, comm.size))


def resolve(name: str, algorithm: str, algos: dict, comm: Communicator, nbytes: int, check: Check) -> str:
    transport = getattr(comm, "transport", None)           # shm transport: auto may pick "shm"
    if algorithm == "auto":
        from primitives.engine.topology import prefers_hierarchical   # multinode: ranks on >1 node
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


__all__ = ["ReduceOp", "CollectiveError", "Check", "run", "chunk_bounds", "scratch", "flat_work",
           "combine_", "finish_avg_", "wait_all", "resolve", "get_comm", "set_handshake",
           "pipeline_segments", "PIPELINE_BYTES"]
