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

overlap_comm: at the boundary micro-batch a unit's reduce-scatter starts from the gradient hook
that completes it (in unit order, so every rank issues the same sequence) on the engine's
communication thread, and backward goes on computing earlier layers; after_backward waits for
all of them. The bytes and the result are the same; only *when* they move changes.
reduce_scatter: false all-reduces each unit instead (2× the bytes, the owner's block is the same).
Every buffer is created on the parameters' device (engine.device).

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
        lay, dt, self.dev = engine.layout, engine.dtype, engine.device
        z = engine.config.zero
        self.overlap = z.overlap_comm and engine.comm.size > 1
        self.use_rs = z.reduce_scatter
        self.inflight: list = []                          # Pending reductions, oldest first
        self.boundary = True
        self.pending = {u.index: len(u.slots) for u in lay.units}
        self.next_unit = 0
        self.flat = [torch.zeros(n, dtype=dt, device=self.dev) for n in lay.group_flat]
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
        self.gflat = [torch.zeros(n, dtype=self.e.dtype, device=self.dev) for n in lay.group_flat]
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
            self._arrived(unit)
        return hook

    def _unit_grad(self, u) -> torch.Tensor:
        return self.gflat[u.group][u.flat_offset:u.flat_offset + u.padded]

    def _arrived(self, u) -> None:
        self.pending[u.index] -= 1
        if self.pending[u.index] == 0 and self._reduce_in_backward():
            units = self.e.layout.units     # in unit order, never completion order: ranks pair up
            while self.next_unit < len(units) and self.pending[units[self.next_unit].index] == 0:
                self._reduce(units[self.next_unit])
                self.next_unit += 1

    def _reduce_in_backward(self) -> bool:
        """Stage 1 reduces only at the boundary, and from the hooks only when overlapping."""
        return self.overlap and self.boundary

    def _launch_reduce(self, b: torch.Tensor, u, then=None, tag: int = 0) -> None:
        """Sum bucket b over ranks into this rank's block of it (reduce-scatter, or all-reduce when
        reduce_scatter is false), asynchronously with overlap_comm; then() once the block is there."""
        c = self.e.comm
        lo, hi = u.shard_range(c.rank)
        if self.use_rs:
            h = c.reduce_scatter(b[lo:hi], b, "grad reduce-scatter", tag=tag, async_op=self.overlap, what=u.tag)
        else:
            h = c.all_reduce(b, "grad all-reduce", async_op=self.overlap, what=u.tag)
        if h is None:
            if then is not None:
                then()
        else:
            if then is not None:
                h.then(then)
            self.inflight.append(h)

    def _reduce(self, u) -> None:
        self._launch_reduce(self._unit_grad(u), u)
        self.pending[u.index] = -1

    def wait_all(self) -> None:
        while self.inflight:
            self.inflight.pop(0).wait()

    def before_backward(self, boundary: bool) -> None:
        self.boundary = boundary
        self.pending = {u.index: len(u.slots) for u in self.e.layout.units}
        self.next_unit = 0

    def after_backward(self, boundary: bool) -> None:
        if boundary:                   # accumulation micro-batches: nothing leaves the rank
            for u in self.e.layout.units[self.next_unit:]:   # what the hooks did not launch, in order
                if self.pending[u.index] != -1:
                    self._reduce(u)
            self.next_unit = len(self.e.layout.units)
        self.wait_all()

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

    def after_load(self) -> None:
        pass

    def memory(self) -> dict:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": nb(self.flat), "grads": nb(self.gflat)}


class Stage0(Stage1):
    """Plain data parallel with the same flat buffers: all-reduce, everyone steps everything.
    The layout is built for one 'shard' (world_size=1), so rank r 'owns' the whole unit."""
    stage = 0

    def owner(self) -> int:
        return 0

    def _reduce(self, u) -> None:
        h = self.e.comm.all_reduce(self._unit_grad(u), "grad all-reduce", async_op=self.overlap, what=u.tag)
        if h is not None:
            self.inflight.append(h)
        self.pending[u.index] = -1

    def after_step(self) -> None:
        pass
