"""ZeRO-1 (ZeRO paper, arXiv 1910.02054, P_os): partition the optimizer states. And ZeRO-0.

    python -m pytest tests/test_zero_units.py -k textbook          (2 ranks, against one process)

Every rank keeps the full parameters (one flat buffer per param group, each parameter a view
into it) and the full gradients (a second flat buffer the gradient hooks add into), so gradient
accumulation needs no communication until the last micro-batch. At that boundary each unit's
gradient is reduce-scattered: rank r receives the SUM of block r over all ranks (in place, into
its own block), steps Adam on that block only (optim.py), then all-gathers the updated blocks
back into every rank's flat buffer.

Memory per rank (fp32, K = 8 for Adam's m and v): 4Ψ + 4Ψ + 8Ψ/N instead of 16Ψ.
Communication per step and rank: reduce-scatter (N-1)/N·Ψ + all-gather (N-1)/N·Ψ = 2(N-1)/N·Ψ,
the bytes of DDP's all-reduce. ZeRO-0 (`Stage0`) all-reduces instead and every rank steps all.

`comm` is any object with the collective methods all_reduce(t), reduce_scatter_single(out, inp),
all_gather_single(out, inp), broadcast(t, src), each summing (or gathering) over its group;
`comm.rank`, `comm.size`. A call may return a handle with wait() (asynchronous): `_launch` keeps
it and `then` runs after the wait. Every rank must call backward and step the same number of
times, in the same order: the collectives pair up, or the ranks hang.
"""
from __future__ import annotations

import torch


class Stage1:
    stage = 1
    reduce_scatter = True         # the one reduce: reduce-scatter, or all-reduce (stage 0 / the engine's choice)

    def __init__(self, comm, layout, params: dict, dtype: torch.dtype, device: torch.device):
        self.comm, self.layout, self.params, self.dtype, self.dev = comm, layout, params, dtype, device
        self.rank = comm.rank
        self.inflight: list = []                          # (handle, then) of asynchronous reductions
        self.boundary, self.next_unit = True, 0
        self.pending = {u.index: len(u.slots) for u in layout.units}
        self._make_param_storage()
        self._make_grad_storage()
        self.hooks = [params[s.name].register_post_accumulate_grad_hook(self._make_hook(u, s))
                      for u in layout.units for s in u.slots]

    def kw(self, purpose: str, u=None) -> dict:
        """Extra keywords for one collective: none here. The engine's subclasses add the ledger's
        label, async_op and a divergence tag (zero_from_scratch/engine/stages.py)."""
        return {}

    # ------------------------------------------------------------------ parameters
    def _make_param_storage(self) -> None:
        """Full flat parameters; rank 0's weights everywhere (DeepSpeed starts from them too)."""
        self.flat = [torch.zeros(n, dtype=self.dtype, device=self.dev) for n in self.layout.group_flat]
        for u in self.layout.units:                       # params become views into flat
            base = self.flat[u.group][u.flat_offset:u.flat_offset + u.padded]
            for s in u.slots:
                p = self.params[s.name]
                view = base[s.offset:s.offset + s.numel].view(s.shape)
                view.copy_(p.data)
                p.data = view
        for buf in self.flat:
            if self.comm.size > 1:
                self.comm.broadcast(buf, 0, **self.kw("init broadcast"))

    # ------------------------------------------------------------------ gradients
    def _make_grad_storage(self) -> None:
        self.gflat = [torch.zeros(n, dtype=self.dtype, device=self.dev) for n in self.layout.group_flat]
        self.gview = {}
        for u in self.layout.units:
            base = self._unit_grad(u)
            for s in u.slots:
                self.gview[s.name] = base[s.offset:s.offset + s.numel].view(s.shape)

    def _make_hook(self, unit, slot):
        view = self.gview[slot.name]

        def hook(p):
            view.add_(p.grad)          # accumulate into the flat buffer; autograd's copy is dropped
            p.grad = None
            self._arrived(unit)
        return hook

    def _unit_grad(self, u) -> torch.Tensor:
        return self.gflat[u.group][u.flat_offset:u.flat_offset + u.padded]

    def _arrived(self, u) -> None:
        """A gradient of u arrived; reduce, in unit order (never completion order: ranks pair up),
        every unit that is complete, when this stage reduces during backward."""
        self.pending[u.index] -= 1
        if self.pending[u.index] == 0 and self._reduce_in_backward():
            units = self.layout.units
            while self.next_unit < len(units) and self.pending[units[self.next_unit].index] == 0:
                self._reduce(units[self.next_unit])
                self.next_unit += 1

    def _reduce_in_backward(self) -> bool:
        """Stage 1 reduces at the boundary, after backward (the engine also from the hooks)."""
        return False

    def _launch(self, h, then=None) -> None:
        """h: a collective's handle (None when it ran synchronously); then() once it is done."""
        if h is None:
            if then is not None:
                then()
        else:
            self.inflight.append((h, then))

    def _wait_oldest(self) -> None:
        h, then = self.inflight.pop(0)
        h.wait()
        if then is not None:
            then()

    def wait_all(self) -> None:
        while self.inflight:
            self._wait_oldest()

    def _sum_into_block(self, b: torch.Tensor, u, then=None) -> None:
        """The one reduce: bucket b summed over ranks into this rank's block of it (reduce-scatter),
        or everywhere (all-reduce)."""
        if self.reduce_scatter:
            lo, hi = u.shard_range(self.rank)
            h = self.comm.reduce_scatter_single(b[lo:hi], b, **self.kw("grad reduce-scatter", u))
        else:
            h = self.comm.all_reduce(b, **self.kw("grad all-reduce", u))
        self._launch(h, then)

    def _reduce(self, u) -> None:
        self._sum_into_block(self._unit_grad(u), u)
        self.pending[u.index] = -1

    def before_backward(self, boundary: bool) -> None:
        self.boundary, self.next_unit = boundary, 0
        self.pending = {u.index: len(u.slots) for u in self.layout.units}

    def after_backward(self, boundary: bool) -> None:
        if boundary:                   # accumulation micro-batches: nothing leaves the rank
            for u in self.layout.units[self.next_unit:]:
                if self.pending[u.index] != -1:
                    self._reduce(u)
            self.next_unit = len(self.layout.units)
        self.wait_all()

    # ------------------------------------------------------------------ what the optimizer sees
    def owner(self) -> int:
        return self.rank

    def param_shard(self, u) -> torch.Tensor:
        lo, hi = u.shard_range(self.owner())
        return self.flat[u.group][u.flat_offset + lo:u.flat_offset + hi]

    def grad_shard(self, u) -> torch.Tensor:
        lo, hi = u.shard_range(self.owner())
        return self._unit_grad(u)[lo:hi]

    def zero_grad(self) -> None:
        for b in self.gflat:
            b.zero_()

    def after_step(self) -> None:
        """Every rank stepped its block: all-gather the blocks back into the full parameters."""
        for u in self.layout.units:
            full = self.flat[u.group][u.flat_offset:u.flat_offset + u.padded]
            self.comm.all_gather_single(full, self.param_shard(u), **self.kw("param all-gather", u))

    def memory(self) -> dict:
        return {"params": _nbytes(self.flat), "grads": _nbytes(self.gflat)}


class Stage0(Stage1):
    """Plain data parallel on the same flat buffers: all-reduce, every rank steps everything.
    The layout is built for world_size=1, so every rank 'owns' the whole unit."""
    stage = 0
    reduce_scatter = False

    def owner(self) -> int:
        return 0

    def after_step(self) -> None:
        pass


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)
