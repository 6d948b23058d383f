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

overlap_comm: each bucket's reduce-scatter is launched asynchronously from the hook that
completes it (still in unit order) and backward goes on; its block is added to the gradient
shard when it is waited for (at the latest at the end of backward).
contiguous_gradients: true = bucket buffers are preallocated (max unit size) and reused: one,
or two with overlap_comm (one fills while the other is on the wire; when both are busy the hook
waits for the older one, as DeepSpeed's double ipg buffer does); more only when backward
interleaves buckets. false = a fresh buffer per bucket, freed after its reduce-scatter.
Neither changes a single bit of the result; `bucket_allocs` counts the allocations.
"""
from __future__ import annotations

import torch

from zero_from_scratch.stage1 import Stage1


class Stage2(Stage1):
    stage = 2
    full_grads = False

    def _make_grad_storage(self) -> None:
        lay, z = self.e.layout, self.e.config.zero
        self.gshard = [torch.zeros(n, dtype=self.e.dtype, device=self.dev) for n in lay.group_local]
        self.bucket: dict[int, torch.Tensor] = {}
        self.base_of: dict[int, torch.Tensor] = {}        # unit -> the pool buffer its bucket is a view of
        self.contiguous = z.contiguous_gradients
        self.cap = max((u.padded for u in lay.units), default=0)
        self.pool_free: list[torch.Tensor] = []
        self.pool_size = self.bucket_allocs = 0
        self.slot_of = {s.name: (u, s) for u in lay.units for s in u.slots}

    def _make_hook(self, unit, slot):
        def hook(p):
            self._add_grad(unit, slot, p.grad)
            p.grad = None
        return hook

    def _new_bucket(self, u) -> torch.Tensor:
        if not self.contiguous:
            self.bucket_allocs += 1
            b = self.bucket[u.index] = torch.zeros(u.padded, dtype=self.e.dtype, device=self.dev)
            return b
        limit = 2 if self.overlap else 1
        while not self.pool_free and self.inflight and self.pool_size >= limit:
            self.inflight.pop(0).wait()                      # its then() hands its buffer back
        if not self.pool_free:
            self.pool_free.append(torch.empty(self.cap, dtype=self.e.dtype, device=self.dev))
            self.pool_size += 1
            self.bucket_allocs += 1
        base = self.base_of[u.index] = self.pool_free.pop()
        b = self.bucket[u.index] = base[:u.padded].zero_()
        return b

    def _add_grad(self, u, s, grad) -> None:
        b = self.bucket.get(u.index)
        if b is None:
            b = self._new_bucket(u)
        b[s.offset:s.offset + s.numel].add_(grad.reshape(-1))
        self._arrived(u)

    def _reduce_in_backward(self) -> bool:
        return True                    # every micro-batch: the full gradient is never kept

    def _reduce(self, u, tag: int = 0) -> None:
        if u.index not in self.bucket:
            self._new_bucket(u)                             # no gradient here this micro-batch: zeros
        b, base = self.bucket.pop(u.index), self.base_of.pop(u.index, None)
        lo, hi = u.shard_range(self.e.comm.rank)
        dst = self.grad_shard(u)

        def then():
            dst.add_(b[lo:hi])
            if base is not None:
                self.pool_free.append(base)
        self._launch_reduce(b, u, then, tag)
        self.pending[u.index] = -1                          # done for this micro-batch

    def after_backward(self, boundary: bool) -> None:
        for u in self.e.layout.units[self.next_unit:]:       # flush what backward did not complete
            if self.pending[u.index] != -1:
                self._reduce(u)
        self.next_unit = len(self.e.layout.units)
        self.wait_all()

    def grad_shard(self, u) -> torch.Tensor:
        return self.gshard[u.group][u.local_offset:u.local_offset + u.shard]

    def zero_grad(self) -> None:
        for b in self.gshard:
            b.zero_()

    def memory(self) -> dict:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": nb(self.flat), "grads": nb(self.gshard)}
