"""Argument checks and the call's fingerprint: what the check round (envelope.py) compares.

    python -m pytest -q -x tests/test_primitives_errors.py

Check collects this rank's argument errors (wrong type, dtype, device, rank, list length, size);
the checked call (core.run) raises them on EVERY rank, via the check round, instead of letting
one rank hang. The fingerprint is the call encoded as ints: call and algorithm names (crc32),
op and dtype codes, root, numel, shape hash, the caller's tag.
"""
from __future__ import annotations

import functools
import zlib

import torch
import torch.distributed as dist

from primitives.engine.algos import ALGORITHMS, group_rank

ReduceOp = dist.ReduceOp

OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
       ReduceOp.AVG: "avg", ReduceOp.BAND: "band", ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor"}
OP_CODES = {n: i for i, n in enumerate(("sum", "product", "min", "max", "avg", "band", "bor", "bxor"))}
BITWISE = ("band", "bor", "bxor")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool)
DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}


def _is_premul(op) -> bool:
    return getattr(op, "op", op) == ReduceOp.PREMUL_SUM or op == ReduceOp.PREMUL_SUM


def op_name(op) -> str | None:
    if isinstance(op, str):
        return op.lower() if op.lower() in OP_CODES else None
    for k, v in OPS.items():
        try:
            if op == k:
                return v
        except Exception:
            pass
    return None


class Check:
    """Collects this rank's argument errors; the checked call (core.run) raises them on every rank."""

    def __init__(self, comm, name: str):
        self.comm, self.name, self.errors = comm, name, []

    def fail(self, msg: str) -> None:
        self.errors.append(msg)

    def tensor(self, arg: str, t) -> bool:
        if not isinstance(t, torch.Tensor):
            self.fail(f"argument {arg!r} must be a torch.Tensor, got {type(t).__name__}")
            return False
        if t.layout != torch.strided:
            self.fail(f"argument {arg!r} is a {t.layout} tensor; ringzero's collectives move dense (strided) "
                      f"tensors: pass {arg}.to_dense() (torch's gloo all_reduce alone takes sparse COO)")
            return False
        if t.dtype not in DTYPE_CODES:
            self.fail(f"argument {arg!r} has dtype {t.dtype}; supported: {[str(d) for d in DTYPES]}")
            return False
        if t.device.type != self.comm.device.type:
            self.fail(f"argument {arg!r} is on {t.device} but backend {self.comm.backend} "
                      f"needs {self.comm.device.type} tensors")
            return False
        return True

    def op(self, op, dtype) -> str:
        name = op_name(op)
        if name is None:
            why = ("PREMUL_SUM is nccl's (torch's gloo refuses it too); scale the tensor, then SUM"
                   if _is_premul(op) else "expected torch.distributed.ReduceOp SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR or BXOR")
            self.fail(f"argument 'op' is {op!r}; {why}")
            return "sum"
        if name in BITWISE and dtype is not None and (dtype.is_floating_point or dtype.is_complex):
            self.fail(f"argument 'op' is {name.upper()}, a bitwise op: it needs an integer or bool tensor, not {dtype}")
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

    def root(self, arg: str, value, group_value) -> int:
        """The root as a group rank, from torch's pair: `arg` (a global rank) or `group_<arg>` (a
        rank of the group), exactly one of them given."""
        if group_value is None:
            if value is None:
                self.fail(f"arguments {arg!r} and 'group_{arg}' are both None; pass one ({arg}: a global rank, "
                          f"group_{arg}: a rank of the group)")
                return 0
            return self.rank(arg, value)
        if value is not None:
            self.fail(f"arguments {arg!r} = {value} and 'group_{arg}' = {group_value} are both given; "
                      f"torch.distributed takes one of them")
            return 0
        if not isinstance(group_value, int) or isinstance(group_value, bool) or not 0 <= group_value < self.comm.size:
            self.fail(f"argument 'group_{arg}' = {group_value!r} is not a rank of this group of {self.comm.size}")
            return 0
        return group_value

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


@functools.lru_cache(maxsize=4096)     # names and shapes repeat every step: hash each once
def code(s: str) -> int:
    return zlib.crc32(s.encode()) & 0x7FFFFFFF


def meta_desc(row) -> str:
    """A fingerprint (call, algorithm, op, root, dtype, numel, shape, tag: core.fingerprint) as words."""
    known = {code(s): s for s in [*ALGORITHMS, *(a for v in ALGORITHMS.values() for a in v)]}
    call, algorithm, op, root, dt, numel, shape, tag = row[:8]
    dtype = DTYPES[dt] if 0 <= dt < len(DTYPES) else "?"
    return (f"(call={known.get(call, '?')}, algorithm={known.get(algorithm, '?')}, dtype={dtype}, "
            f"numel={numel}, shape#={shape}, tag={tag}, op={list(OP_CODES)[op] if op >= 0 else '-'}, root={root})")


class CallName:
    """'all_reduce(algorithm=ring) call #7', formatted only when an error message needs it."""
    __slots__ = ("name", "algorithm", "k")

    def __init__(self, name, algorithm, k):
        self.name, self.algorithm, self.k = name, algorithm, k

    def __str__(self):
        return f"{self.name}(algorithm={self.algorithm}) call #{self.k}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731

    def __bool__(self):
        return True
