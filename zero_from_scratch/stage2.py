"""ZeRO-2: partition the gradients too. Only what differs from stage1.py.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.demo --stage 2

The full-size gradient buffer is gone. Each unit (bucket of ≤ reduce_bucket_size elements) gets
a temporary gradient buffer when backward produces its first gradient; when the post-
accumulate-grad hooks have delivered every gradient of the unit, it is reduce-scattered and the
rank adds its block to its *gradient shard* (Ψ/N elements); the bucket is then dropped.

Ordering: buckets are reduced in unit order (reverse registration ≈ backward order), never in
the order they happen to complete, so every rank issues the same sequence of collectives even
if autograd visits parameters differently; units whose parameters got no gradient are flushed,
in order, at the end of backward.

Cost per micro-batch: reduce-scatter (N-1)/N·Ψ; per step: + all-gather (N-1)/N·Ψ. With
gradient accumulation the reduce-scatter happens on *every* micro-batch (the full gradient is
not kept), which is the price of 4Ψ → 4Ψ/N gradient memory.
"""
from __future__ import annotations

import torch

from zero_from_scratch.stage1 import Stage1


class Stage2(Stage1):
    stage = 2
    full_grads = False

    def _make_grad_storage(self) -> None:
        lay = self.e.layout
        self.gshard = [torch.zeros(n, dtype=self.e.dtype) for n in lay.group_local]
        self.bucket: dict[int, torch.Tensor] = {}
        self.pending = {u.index: len(u.slots) for u in lay.units}
        self.slot_of = {s.name: (u, s) for u in lay.units for s in u.slots}
        self.next_unit = 0

    def _make_hook(self, unit, slot):
        def hook(p):
            self._add_grad(unit, slot, p.grad)
            p.grad = None
        return hook

    def _add_grad(self, u, s, grad) -> None:
        b = self.bucket.get(u.index)
        if b is None:
            b = self.bucket[u.index] = torch.zeros(u.padded, dtype=self.e.dtype)
        b[s.offset:s.offset + s.numel].add_(grad.reshape(-1))
        self.pending[u.index] -= 1
        if self.pending[u.index] == 0:
            self._unit_complete(u)

    def _unit_complete(self, u) -> None:
        units = self.e.layout.units
        while self.next_unit < len(units) and self.pending[units[self.next_unit].index] == 0:
            self._reduce(units[self.next_unit])
            self.next_unit += 1

    def _reduce(self, u, tag: int = 0) -> None:
        c = self.e.comm
        b = self.bucket.pop(u.index, None)
        if b is None:
            b = torch.zeros(u.padded, dtype=self.e.dtype)    # no gradient here this micro-batch
        lo, hi = u.shard_range(c.rank)
        c.reduce_scatter(b[lo:hi], b, "grad reduce-scatter", tag=tag)
        self.gshard[u.group][u.local_offset:u.local_offset + u.shard].add_(b[lo:hi])
        self.pending[u.index] = -1                              # done for this micro-batch

    def before_backward(self, boundary: bool) -> None:
        self.pending = {u.index: len(u.slots) for u in self.e.layout.units}
        self.next_unit = 0

    def after_backward(self, boundary: bool) -> None:
        for u in self.e.layout.units[self.next_unit:]:       # flush what backward did not complete
            if self.pending[u.index] != -1:
                self._reduce(u)
        self.next_unit = len(self.e.layout.units)

    def grad_shard(self, u) -> torch.Tensor:
        return self.gshard[u.group][u.local_offset:u.local_offset + u.shard]

    def zero_grad(self) -> None:
        for b in self.gshard:
            b.zero_()

    def memory(self) -> dict:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": nb(self.flat), "grads": nb(self.gshard)}
