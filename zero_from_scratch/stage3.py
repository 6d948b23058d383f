"""ZeRO-3 (ZeRO paper, P_os+g+p): partition the parameters too. Only what differs from stage2.py.

    python -m pytest tests/test_zero_units.py -k textbook          (2 ranks, against one process)

A unit is one module's own parameters (per param group). Between uses a rank keeps only its
shard (Ψ/N elements); every parameter's `.data` is an empty tensor (torch.Size([0]), as
DeepSpeed leaves them). Module hooks bring the full parameters just in time:

  forward pre-hook      all-gather the module's units                (N-1)/N·Ψ per micro-batch
  forward post-hook     release them
  backward pre-hook     all-gather again for the module's backward   (N-1)/N·Ψ
  gradient hooks        when a unit's gradients are complete: reduce-scatter into the
                        gradient shard (stage2.py), release the parameters (N-1)/N·Ψ

Communication: 3(N-1)/N·Ψ per micro-batch, 1.5× DDP. Memory per rank (fp32): (4 + 4 + 8)Ψ/N,
plus the units gathered at one time. The optimizer steps the shard in place; nothing is
all-gathered after the step: the next forward gathers. Every rank must run the same modules the
same number of times in the same order, or the all-gathers pair up wrongly (or hang).
Releasing frees memory only if nothing else holds the gathered buffer: autograd saves a
Linear's weight for backward, which the engine saves by reference instead
(zero_from_scratch/engine/stage3.py).
"""
from __future__ import annotations

import contextlib

import torch

from zero_from_scratch.stage1 import _nbytes
from zero_from_scratch.stage2 import Stage2


class Stage3(Stage2):
    stage = 3

    def __init__(self, comm, layout, params: dict, dtype: torch.dtype, device: torch.device, module):
        self.full_of: dict[int, torch.Tensor] = {}        # unit -> its gathered buffer, while gathered
        super().__init__(comm, layout, params, dtype, device)
        unit_of_param = {id(params[s.name]): u for u in layout.units for s in u.slots}
        for name, m in module.named_modules():
            us = sorted({unit_of_param[id(p)].index for p in m.parameters(recurse=False) if id(p) in unit_of_param})
            if us:
                self.add_module_hooks(name, m, [layout.units[i] for i in us])

    def _make_param_storage(self) -> None:
        """This rank's shards only, built one unit at a time (never the whole model at once)."""
        self.flat = []
        self.pshard = [torch.zeros(n, dtype=self.dtype, device=self.dev) for n in self.layout.group_local]
        for u in self.layout.units:
            self.param_shard(u).copy_(self._unit_block(u))

    def _unit_block(self, u) -> torch.Tensor:
        """This rank's block of u: rank 0's full unit, broadcast (DeepSpeed starts from rank 0's
        weights too); the parameters' full tensors are dropped."""
        full = torch.zeros(u.padded, dtype=self.dtype, device=self.dev)
        for s in u.slots:
            full[s.offset:s.offset + s.numel].copy_(self.params[s.name].data.reshape(-1))
            self.params[s.name].data = torch.empty(0, dtype=self.dtype, device=self.dev)
        if self.comm.size > 1:
            self.comm.broadcast(full, 0, **self.kw("init broadcast"))
        lo, hi = u.shard_range(self.rank)
        return full[lo:hi]

    def add_module_hooks(self, name: str, m: torch.nn.Module, units: list) -> None:
        self.hooks += [m.register_forward_pre_hook(self._pre_forward(name, units)),
                       m.register_forward_hook(self._post_forward(units)),
                       m.register_full_backward_pre_hook(self._pre_backward(name, units))]

    # ------------------------------------------------------------------ gather before use, release after
    def _gather(self, u, kind: str, label: str) -> None:
        """Full parameters of u, now. kind: "forward", "backward" or "gather_ctx"; label names the module."""
        if u.index not in self.full_of:
            self._install(u, self._fetch(u, kind))

    def _fetch(self, u, kind: str) -> torch.Tensor:
        """u's full parameters, all-gathered from every rank's shard."""
        full = self._empty_unit(u)
        self.comm.all_gather_single(full, self.param_shard(u), **self.kw(f"param all-gather ({kind})", u))
        return full

    def _empty_unit(self, u) -> torch.Tensor:
        """A buffer for u's full parameters (the engine reuses them: engine/pools.py)."""
        return torch.empty(u.padded, dtype=self.dtype, device=self.dev)

    def _install(self, u, full: torch.Tensor) -> None:
        for s in u.slots:
            self.params[s.name].data = full[s.offset:s.offset + s.numel].view(s.shape)
        self.full_of[u.index] = full

    def _release(self, u, kind: str) -> None:
        """Drop u's full parameters. kind names the moment ("forward": after the module's forward,
        "reduce": its gradients were reduced, "backward": end of backward, "gather_ctx"): the engine
        keeps some units gathered by it (reuse, persistence)."""
        if self.full_of.pop(u.index, None) is not None:
            for s in u.slots:
                self.params[s.name].data = torch.empty(0, dtype=self.dtype, device=self.dev)

    def _pre_forward(self, name, units):
        def hook(module, args):
            for u in units:
                self._gather(u, "forward", f"forward of {name!r}")
        return hook

    def _post_forward(self, units):
        def hook(module, args, output):
            for u in units:
                self._release(u, "forward")
        return hook

    def _pre_backward(self, name, units):
        def hook(module, grad_output):
            for u in units:
                self._gather(u, "backward", f"backward of {name!r}")
        return hook

    # ------------------------------------------------------------------ gradients: reduce when complete
    def _arrived(self, u) -> None:
        self.pending[u.index] -= 1
        if self.pending[u.index] == 0:  # at once: autograd completes units in the same order on every rank
            self._reduce(u)

    def _reduce(self, u) -> None:
        super()._reduce(u)
        self._release(u, "reduce")

    def after_backward(self, boundary: bool) -> None:
        for u in self.layout.units:    # units with no gradient (unused this micro-batch), in unit order
            if self.pending[u.index] != -1:
                self._reduce(u)
        self.wait_all()
        for i in list(self.full_of):
            self._release(self.unit(i), "backward")

    def unit(self, i: int):
        return self.layout.units[i]

    # ------------------------------------------------------------------ optimizer view
    def param_shard(self, u) -> torch.Tensor:
        return self.pshard[u.group][u.local_offset:u.local_offset + u.shard]

    def after_step(self) -> None:
        pass                           # the shards were stepped in place; the next forward gathers

    @contextlib.contextmanager
    def gathered(self, units: list):
        """Full parameters of `units` inside the block, e.g. to read weights outside forward
        (all ranks must enter it: it all-gathers)."""
        mine = [u for u in units if u.index not in self.full_of]
        for u in mine:
            self._gather(u, "gather_ctx", f"gathered({u.tag!r})")
        try:
            yield
        finally:
            for u in mine:
                self._release(u, "gather_ctx")

    def memory(self) -> dict:
        return {"params": _nbytes(self.pshard), "grads": _nbytes(self.gshard)}

