"""ZeRO-2 (ZeRO paper, P_os+g): partition the gradients too. Only what differs from stage1.py.

    python -m pytest tests/test_zero_units.py -k textbook          (2 ranks, against one process)

The full-size gradient buffer is gone. Each unit (a bucket of consecutive parameters) gets a
temporary gradient buffer when backward produces its first gradient; once the hooks have
delivered every gradient of the unit it is reduce-scattered, the rank adds its block to its
*gradient shard* (Ψ/N elements), and the bucket is dropped. Buckets are reduced in unit order
(reverse registration ≈ backward order), never in completion order, so every rank issues the
same collectives; units that got no gradient are flushed, in order, after backward.

Memory per rank (fp32): 4Ψ + (4 + 8)Ψ/N, plus one bucket in flight.
Communication per micro-batch: reduce-scatter (N-1)/N·Ψ; per step: + all-gather (N-1)/N·Ψ.
With gradient accumulation the reduce-scatter runs on EVERY micro-batch (the full gradient is
not kept): the price of 4Ψ → 4Ψ/N gradient memory.
"""
from __future__ import annotations

import torch

from zero_from_scratch.stage1 import Stage1, _nbytes


class Stage2(Stage1):
    stage = 2

    def _make_grad_storage(self) -> None:
        self.gshard = [torch.zeros(n, dtype=self.dtype, device=self.dev) for n in self.layout.group_local]
        self.bucket: dict[int, torch.Tensor] = {}         # unit -> its gradient bucket this micro-batch

    def _make_hook(self, unit, slot):
        def hook(p):
            b = self.bucket.get(unit.index)
            if b is None:
                b = self.bucket[unit.index] = self._new_bucket(unit)
            b[slot.offset:slot.offset + slot.numel].add_(p.grad.reshape(-1))
            p.grad = None
            self._arrived(unit)
        return hook

    def _new_bucket(self, u) -> torch.Tensor:
        return torch.zeros(u.padded, dtype=self.dtype, device=self.dev)

    def _bucket_done(self, u, b: torch.Tensor) -> None:
        """The reduce-scatter of u's bucket b finished: b may be reused (the engine pools them)."""

    def _reduce_in_backward(self) -> bool:
        return True                    # every micro-batch: the full gradient is never kept

    def _reduce(self, u) -> None:
        b = self.bucket.pop(u.index, None)
        if b is None:                                     # no gradient here this micro-batch: zeros
            b = self._new_bucket(u)
        lo, hi = u.shard_range(self.rank)
        dst = self.grad_shard(u)

        def then():
            dst.add_(b[lo:hi])
            self._bucket_done(u, b)
        self._sum_into_block(b, u, then)
        self.pending[u.index] = -1                        # done for this micro-batch

    def after_backward(self, boundary: bool) -> None:
        for u in self.layout.units[self.next_unit:]:      # flush what backward did not complete
            if self.pending[u.index] != -1:
                self._reduce(u)
        self.next_unit = len(self.layout.units)
        self.wait_all()

    def grad_shard(self, u) -> torch.Tensor:
        return self.gshard[u.group][u.local_offset:u.local_offset + u.shard]

    def zero_grad(self) -> None:
        for b in self.gshard:
            b.zero_()

    def memory(self) -> dict:
        return {"params": _nbytes(self.flat), "grads": _nbytes(self.gshard)}
