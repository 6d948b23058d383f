"""ZeRO-1 (and ZeRO-0 = plain data parallel): partition the optimizer states.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.demo --stage 1

Every rank keeps the full parameters (one flat buffer per param group; each parameter is a
view into it) and the full gradients (a second flat buffer the gradient hooks add into).
Gradient accumulation therefore needs no communication at all until the last micro-batch.
At the boundary each unit's gradient is reduce-scattered: rank r receives the *sum* of block r
over all ranks (in place, into its own block), steps Adam on that block only, then the updated
blocks are all-gathered back into every rank's flat buffer.

Per step and rank: reduce-scatter (N-1)/N·Ψ + all-gather (N-1)/N·Ψ = 2(N-1)/N·Ψ, the same
bytes as DDP's all-reduce, for Adam memory 8Ψ/N instead of 8Ψ (fp32).
ZeRO-0 (`Stage0`) all-reduces instead and every rank steps everything.

All ranks must call backward and step the same number of times (the collectives pair up).
"""
from __future__ import annotations

import contextlib

import torch


class Stage1:
    stage = 1
    full_grads = True          # a full-size gradient buffer lives across micro-batches

    def __init__(self, engine):
        self.e = engine
        lay, dt = engine.layout, engine.dtype
        self.flat = [torch.zeros(n, dtype=dt) for n in lay.group_flat]
        self.params = engine.params_by_name
        for u in lay.units:                               # params become views into flat
            base = self.flat[u.group][u.flat_offset:u.flat_offset + u.padded]
            for s in u.slots:
                p = self.params[s.name]
                view = base[s.offset:s.offset + s.numel].view(s.shape)
                view.copy_(p.data)
                p.data = view
        for g, buf in enumerate(self.flat):               # DeepSpeed also starts from rank 0's weights
            if engine.comm.size > 1:
                engine.comm.broadcast(buf, 0, "init broadcast")
        self._make_grad_storage()
        self.hooks = [self.params[s.name].register_post_accumulate_grad_hook(self._make_hook(u, s))
                      for u in lay.units for s in u.slots]

    # ------------------------------------------------------------------ gradients
    def _make_grad_storage(self) -> None:
        lay = self.e.layout
        self.gflat = [torch.zeros(n, dtype=self.e.dtype) for n in lay.group_flat]
        self.gview = {}
        for u in lay.units:
            base = self.gflat[u.group][u.flat_offset:u.flat_offset + u.padded]
            for s in u.slots:
                self.gview[s.name] = base[s.offset:s.offset + s.numel].view(s.shape)

    def _make_hook(self, unit, slot):
        view = self.gview[slot.name]

        def hook(p):
            view.add_(p.grad)          # accumulate into the flat buffer; autograd's copy is dropped
            p.grad = None
        return hook

    def _unit_grad(self, u) -> torch.Tensor:
        return self.gflat[u.group][u.flat_offset:u.flat_offset + u.padded]

    def before_backward(self, boundary: bool) -> None:
        pass

    def after_backward(self, boundary: bool) -> None:
        if not boundary:
            return                     # accumulation: nothing leaves the rank
        c = self.e.comm
        for u in self.e.layout.units:
            full = self._unit_grad(u)
            lo, hi = u.shard_range(c.rank)
            c.reduce_scatter(full[lo:hi], full, "grad reduce-scatter")

    # ------------------------------------------------------------------ what the optimizer sees
    def owner(self) -> int:
        return self.e.comm.rank

    def param_shard(self, u) -> torch.Tensor:
        lo, hi = u.shard_range(self.owner())
        return self.flat[u.group][u.flat_offset + lo:u.flat_offset + hi]

    def grad_shard(self, u) -> torch.Tensor:
        lo, hi = u.shard_range(self.owner())
        return self.gflat[u.group][u.flat_offset + lo:u.flat_offset + hi]

    def zero_grad(self) -> None:
        for b in self.gflat:
            b.zero_()

    def after_step(self) -> None:
        c = self.e.comm
        for u in self.e.layout.units:
            full = self.flat[u.group][u.flat_offset:u.flat_offset + u.padded]
            c.all_gather(full, self.param_shard(u), "param all-gather")

    # ------------------------------------------------------------------ full parameters on demand
    @contextlib.contextmanager
    def gathered(self, params, modifier_rank=None):
        """Stages 0-2 hold full parameters already; with modifier_rank, that rank's edits are
        broadcast on exit (and copied into the fp32 master)."""
        yield
        if modifier_rank is not None:
            for buf in self.flat:
                self.e.comm.broadcast(buf, modifier_rank, "gathered_parameters broadcast")
            self.e.refresh_master()

    def memory(self) -> dict:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": nb(self.flat), "grads": nb(self.gflat)}


class Stage0(Stage1):
    """Plain data parallel with the same flat buffers: all-reduce, everyone steps everything.
    The layout is built for one 'shard' (world_size=1), so rank r 'owns' the whole unit."""
    stage = 0

    def owner(self) -> int:
        return 0

    def after_backward(self, boundary: bool) -> None:
        if boundary:
            for u in self.e.layout.units:
                self.e.comm.all_reduce(self._unit_grad(u), "grad all-reduce")

    def after_step(self) -> None:
        pass
