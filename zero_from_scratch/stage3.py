"""ZeRO-3: partition the parameters too. Only what differs from stage2.py.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.demo --stage 3

A unit is one module's own parameters (per param group). Between uses a rank keeps only its
shard (Ψ/N elements); every parameter's `.data` is an empty tensor (torch.Size([0]), exactly as
DeepSpeed leaves them, issue #3570). Module hooks bring full parameters just in time:

  forward pre-hook      all-gather the module's units             (N-1)/N·Ψ per micro-batch
  forward post-hook     free them
  backward pre-hook     all-gather again for the module's backward (N-1)/N·Ψ
  grad hooks            when a unit's gradients are complete: reduce-scatter into the
                        gradient shard and free the parameters     (N-1)/N·Ψ
Total 3(N-1)/N·Ψ per micro-batch. The optimizer steps the shard in place (it is the fp32
master in fp32 mode); nothing is all-gathered after the step: the next forward gathers.

Divergence: every collective carries (what, unit, call#) as its handshake tag (or, with the
handshake off or comm_impl="torch", in one tiny int64 all-gather before it). If a module runs a different number of times, or in a different order, on some
rank, every rank raises ZeroDivergenceError naming the module on each rank, instead of pairing
unrelated collectives or hanging (DeepSpeed #7998).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from zero_from_scratch.stage2 import Stage2

_KIND = {"forward": 1, "backward": 2, "reduce": 3, "gather_ctx": 4}


class _SavedView:
    """Marker: a saved tensor that is a view of a gathered parameter unit (see _pack)."""


class ZeroDivergenceError(RuntimeError):
    """Ranks ran different modules (or a module a different number of times)."""


class Stage3(Stage2):
    stage = 3

    def __init__(self, engine):   # replaces Stage1.__init__: no full flat parameter buffer
        self.e = engine
        lay, dt, c = engine.layout, engine.dtype, engine.comm
        self.params = engine.params_by_name
        self.pshard = [torch.zeros(n, dtype=dt) for n in lay.group_local]
        self.flat = []
        for u in lay.units:
            full = torch.zeros(u.padded, dtype=dt)
            for s in u.slots:
                full[s.offset:s.offset + s.numel].copy_(self.params[s.name].data.reshape(-1))
            if c.size > 1:
                c.broadcast(full, 0, "init broadcast")
            lo, hi = u.shard_range(c.rank)
            self.pshard[u.group][u.local_offset:u.local_offset + u.shard].copy_(full[lo:hi])
        self.gathered_units: set[int] = set()
        self.full_of: dict[int, torch.Tensor] = {}        # unit -> its gathered buffer, while gathered
        self.unit_of_storage: dict[int, int] = {}         # that buffer's storage pointer -> unit
        self.calls: dict[int, int] = {}
        self.tag_of = {u.index: u.tag for u in lay.units}
        for s_name, p in self.params.items():
            p.data = torch.empty(0, dtype=dt)
        self._make_grad_storage()
        self.hooks = [self.params[s.name].register_post_accumulate_grad_hook(self._make_hook(u, s))
                      for u in lay.units for s in u.slots]
        unit_of_param = {id(self.params[s.name]): u for u in lay.units for s in u.slots}
        for name, m in engine.module.named_modules():
            units = sorted({unit_of_param[id(p)].index for p in m.parameters(recurse=False) if id(p) in unit_of_param})
            if not units:
                continue
            us = [lay.units[i] for i in units]
            self.hooks.append(m.register_forward_pre_hook(self._pre_forward(name, us)))
            self.hooks.append(m.register_forward_hook(self._post_forward(us)))
            self.hooks.append(m.register_full_backward_pre_hook(self._pre_backward(name, us)))
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                "respect to module outputs")  # expected: the first module's inputs are token ids

    # ------------------------------------------------------------------ divergence check
    def _check(self, kind: str, u, label: str) -> int:
        """Count this (kind, unit) call and make sure every rank is at the same one.

        With the primitives handshake on, the identity rides along as the collective's `tag`
        (checked in the handshake round the collective does anyway: no extra latency) and is
        only spelled out, by _diverged, once the handshake has flagged a mismatch on every
        rank. Otherwise it costs one tiny all-gather here."""
        c = self.e.comm
        if c.size == 1:
            return 0
        n = self.calls[u.index] = self.calls.get(u.index, 0) + 1
        mine = [_KIND[kind], u.index, n]
        if c.checks_tags:
            return (mine[0] << 48) | (mine[1] << 24) | mine[2]
        self._diverged(c.gather_ints(mine), label)
        return 0

    def _diverged(self, rows, label: str) -> None:
        c = self.e.comm
        if any(r != rows[c.rank] for r in rows):
            def say(r):
                k = {v: key for key, v in _KIND.items()}.get(r[0], "?")
                return f"{k} of module {self.tag_of.get(r[1], '?')!r} (call #{r[2]})"
            desc = "; ".join(f"rank {i}: {say(r)}" for i, r in enumerate(rows))
            raise ZeroDivergenceError(
                f"rank {c.rank}: ZeRO-3 ranks diverged at {label}: {desc}. Every rank must run the same "
                "modules, the same number of times, in the same order (same control flow on every rank)")

    @contextlib.contextmanager
    def _tagged(self, tag: int, label: str):
        """Turn a handshake mismatch of the tagged collective into a ZeroDivergenceError that names
        the modules. Every rank sees the mismatch, so every rank can take part in gather_ints."""
        from primitives import CollectiveError
        try:
            yield
        except CollectiveError as e:
            if not tag:
                raise
            self._diverged(self.e.comm.gather_ints([tag >> 48, (tag >> 24) & 0xFFFFFF, tag & 0xFFFFFF]), label)
            raise ZeroDivergenceError(f"rank {self.e.comm.rank}: ZeRO-3 collective failed at {label}: {e}") from e

    # ------------------------------------------------------------------ gather / release
    def _gather(self, u, kind: str, label: str) -> None:
        if u.index in self.gathered_units:
            return
        tag = self._check(kind, u, label)
        full = torch.empty(u.padded, dtype=self.e.dtype)
        with self._tagged(tag, label):
            self.e.comm.all_gather(full, self.param_shard(u), f"param all-gather ({kind})", tag=tag)
        for s in u.slots:
            self.params[s.name].data = full[s.offset:s.offset + s.numel].view(s.shape)
        self.gathered_units.add(u.index)
        self.full_of[u.index] = full
        self.unit_of_storage[full.untyped_storage().data_ptr()] = u.index

    def _release(self, u) -> None:
        if u.index in self.gathered_units:
            for s in u.slots:
                self.params[s.name].data = torch.empty(0, dtype=self.e.dtype)
            self.gathered_units.discard(u.index)
            full = self.full_of.pop(u.index, None)
            if full is not None:
                self.unit_of_storage.pop(full.untyped_storage().data_ptr(), None)

    # ------------------------------------------------------------------ saved weights
    # Autograd saves what backward needs, and for a Linear that is the weight (as W.t()). Saved
    # as a tensor, it would keep the whole gathered buffer alive from forward to backward, so
    # releasing after forward would free nothing. Instead, a view of a gathered unit is saved as
    # (unit, shape, stride, offset) and rebuilt, on first use in backward, from the buffer the
    # backward pre-hook has gathered again. DeepSpeed gets the same effect with its own Linear.
    @contextlib.contextmanager
    def saved_weights_by_reference(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.layout != torch.strided:
            return t
        idx = self.unit_of_storage.get(t.untyped_storage().data_ptr())
        if idx is None:
            return t
        return (_SavedView, idx, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad)

    def _unpack(self, x):
        if not (isinstance(x, tuple) and x and x[0] is _SavedView):
            return x
        _, idx, shape, stride, offset, _ = x
        full = self.full_of.get(idx)
        if full is None:
            raise RuntimeError(f"rank {self.e.comm.rank}: ZeRO-3 needs the parameters of "
                               f"{self.tag_of.get(idx, idx)!r} in backward but they are not gathered "
                               "(was the module's output used after its backward hook could run?)")
        return full.as_strided(shape, stride, offset)

    def _pre_forward(self, name, units):
        def hook(module, args):
            for u in units:
                self._gather(u, "forward", f"forward of {name!r}")
        return hook

    def _post_forward(self, units):
        def hook(module, args, output):
            for u in units:
                self._release(u)
        return hook

    def _pre_backward(self, name, units):
        def hook(module, grad_output):
            for u in units:
                self._gather(u, "backward", f"backward of {name!r}")
        return hook

    # ------------------------------------------------------------------ gradients: reduce when complete
    def _unit_complete(self, u) -> None:
        self._reduce(u)                 # module order is checked, so no reordering needed

    def _reduce(self, u, tag: int = 0) -> None:
        label = f"gradient reduce-scatter of {u.tag!r}"
        tag = self._check("reduce", u, label)
        with self._tagged(tag, label):
            super()._reduce(u, tag)
        self._release(u)

    def after_backward(self, boundary: bool) -> None:
        for u in self.e.layout.units:    # units with no gradient (unused this micro-batch), in unit order
            if self.pending[u.index] != -1:
                self._reduce(u)
        self.calls.clear()              # call counts restart every micro-batch (same on all ranks)

    def before_backward(self, boundary: bool) -> None:
        self.pending = {u.index: len(u.slots) for u in self.e.layout.units}

    def forward_done(self) -> None:
        """Called before each forward: eval / no-grad passes leave no state behind."""
        if not torch.is_grad_enabled():
            self.calls.clear()

    # ------------------------------------------------------------------ optimizer view
    def param_shard(self, u) -> torch.Tensor:
        return self.pshard[u.group][u.local_offset:u.local_offset + u.shard]

    def after_step(self) -> None:
        pass

    @contextlib.contextmanager
    def gathered(self, params, modifier_rank=None):
        """Full parameters for `params` inside the block (all ranks must enter it). With
        modifier_rank, that rank's edits are broadcast and written back into every shard."""
        lay = self.e.layout
        wanted = {id(p) for p in params}
        units = [u for u in lay.units if any(id(self.params[s.name]) in wanted for s in u.slots)]
        mine = [u for u in units if u.index not in self.gathered_units]
        for u in mine:
            self._gather(u, "gather_ctx", f"gathered_parameters({u.tag!r})")
        try:
            yield
        finally:
            for u in mine:
                if modifier_rank is not None:
                    self.write_back(u, modifier_rank)
                self._release(u)
            if modifier_rank is not None:
                self.e.refresh_master()

    def write_back(self, u, modifier_rank: int) -> None:
        """modifier_rank's (possibly edited) full unit → every rank's shard."""
        c = self.e.comm
        full = torch.empty(u.padded, dtype=self.e.dtype)
        for s in u.slots:
            full[s.offset:s.offset + s.numel].copy_(self.params[s.name].data.reshape(-1))
        if c.size > 1:
            c.broadcast(full, modifier_rank, "gathered_parameters broadcast")
        lo, hi = u.shard_range(c.rank)
        self.param_shard(u).copy_(full[lo:hi])

    def memory(self) -> dict:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": nb(self.pshard), "grads": nb(self.gshard)}
