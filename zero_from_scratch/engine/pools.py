"""The engine's own buffers: one pool per purpose, reused step after step.

    python -m pytest -q tests/test_zero_stage3.py -k pool

A training step at ZeRO-3 needs the same large buffers again and again: each gathered unit
(stage3.py), the gradient shards offload reads in and the shards the step writes (param_offload.py).
Allocated and freed every time, they become free heap the process keeps: glibc serves blocks
below its mmap threshold (128 KiB, raised up to 32 MiB once a mapped block of that size is freed)
from a heap that shrinks only from its top, and small long-lived blocks land between the freed
large ones. A pool hands out buffers of exact sizes, and a buffer given back waits in its size's
free list for the next take: after the first step nothing is allocated or freed for these
purposes, and the pool's bytes are what its purpose needs at its busiest (the stage-3 keys and
offload_param.buffer_count bound that; report.py predicts it). A pool idle for a whole phase
(the writer's shards between steps, the gathered units in the step) is cleared: its blocks are mapped (allocator.py) and return.
Safety: a buffer is reused only when nothing outside the pool still refers to its memory (the
storage's reference count, one call per give). One that something kept (a user's reference to
`param.data`, autograd state saved by value) leaves the pool, counted as `escaped`, and a fresh
buffer takes its place: never two owners of the same bytes.
Cost: none in bytes moved; memory = Σ over sizes of the most buffers of that size in use at once.
"""
from __future__ import annotations

import torch


def _uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class Pool:
    """Buffers of one dtype and device, by exact element count; `name` says what they are for."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device):
        self.name, self.dtype, self.dev = name, dtype, device
        self.free: dict[int, list[torch.Tensor]] = {}
        self.own: dict[int, int] = {}                     # id(buffer) -> its storage's uses when idle
        self.held = self.in_use = self.peak = 0           # bytes: allocated, handed out, most handed out
        self.allocs = self.takes = self.escaped = 0
        self.b = torch.empty(0, dtype=dtype).element_size()

    def take(self, n: int, new=None) -> torch.Tensor:
        """A buffer of n elements (contents undefined); new() allocates one when none is free
        (default: torch.empty)."""
        self.takes += 1
        free = self.free.get(n)
        if free:
            t = free.pop()
        else:
            t = new() if new is not None else torch.empty(n, dtype=self.dtype, device=self.dev)
            self.own[id(t)] = _uses(t)
            self.allocs += 1
            self.held += n * self.b
        self.in_use += n * self.b
        self.peak = max(self.peak, self.in_use)
        return t

    def give(self, t: torch.Tensor) -> None:
        """t (from take) is no longer used by its taker."""
        idle = self.own.get(id(t))
        if idle is None:
            return                                        # not ours (allocated elsewhere): dropped as usual
        self.in_use -= t.numel() * self.b
        if _uses(t) > idle:                               # something still sees these bytes: let it keep them
            del self.own[id(t)]
            self.held -= t.numel() * self.b
            self.escaped += 1
            return
        self.free.setdefault(t.numel(), []).append(t)

    def clear(self) -> None:
        """Free every idle buffer (close, or a change of shapes)."""
        for bufs in self.free.values():
            for t in bufs:
                self.own.pop(id(t), None)
                self.held -= t.numel() * self.b
        self.free = {}

    def report(self) -> dict:
        return {"pool": self.name, "held_bytes": self.held, "peak_in_use_bytes": self.peak,
                "allocations": self.allocs, "takes": self.takes, "escaped": self.escaped}
