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

Prefetch, persistence, reuse (DeepSpeed's stage3_* keys; config.ZERO_KEYS says what each does;
the trace and prefetch logic is in stage3_prefetch.py): the first training micro-batch records the order in which hooks ask for units (forward, then
backward) — the *trace*. Later micro-batches follow it: after each module's demand, the units
next in the trace are all-gathered asynchronously (overlap_comm) up to
stage3_prefetch_bucket_size elements ahead, never letting gathered + in-flight elements exceed
stage3_max_live_parameters (units kept for reuse are evicted first when a demand needs room).
After forward a unit stays gathered if the trace uses it again within stage3_max_reuse_distance
elements (typically the last layers: forward, then at once their backward). Units of at most
stage3_param_persistence_threshold elements are gathered once per optimizer step and kept.
A micro-batch that leaves the trace simply stops prefetching / keeping (demand gathers only).
`stats` counts gathers by kind and the largest live element count seen.

Divergence: every collective carries (what, unit, call#) as its handshake tag (or, with the
handshake off or comm_impl="torch", in one tiny int64 all-gather before it). If a module runs a different number of times, or in a different order, on some
rank, every rank raises ZeroDivergenceError naming the module on each rank, instead of pairing
unrelated collectives or hanging (DeepSpeed #7998).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from primitives import CollectiveError

from zero_from_scratch.stage2 import Stage2
from zero_from_scratch.engine.prefetch import Prefetch

_KIND = {"forward": 1, "backward": 2, "reduce": 3, "gather_ctx": 4}


class _SavedView:
    """Marker: a saved tensor that is a view of a gathered parameter unit (see _pack)."""


class ZeroDivergenceError(RuntimeError):
    """Ranks ran different modules (or a module a different number of times)."""


class Stage3(Prefetch, Stage2):
    stage = 3

    def __init__(self, engine):   # replaces Stage1.__init__: no full flat parameter buffer
        self.e = engine
        lay, dt, c, z = engine.layout, engine.dtype, engine.comm, engine.config.zero
        self.dev = engine.device
        self.overlap = z.overlap_comm and c.size > 1
        self.use_rs = True
        self.inflight: list = []                          # Pending gradient reductions
        self.boundary, self.next_unit = True, 0
        self.pending = {u.index: len(u.slots) for u in lay.units}
        self.persistent = {u.index for u in lay.units if u.numel <= z.stage3_param_persistence_threshold}
        self.max_live = z.stage3_max_live_parameters
        self.reuse_distance = z.stage3_max_reuse_distance
        self.prefetch_budget = z.stage3_prefetch_bucket_size if self.overlap else 0
        self.trace: list | None = None                    # [(kind, unit index)] of the first training micro-batch
        self.recording: list = []
        self.tpos, self.trace_ok, self.in_train = 0, False, False
        self.fwd_pos: dict[int, int] = {}                 # unit -> its trace position in this forward
        self.prefetched: dict[int, tuple] = {}            # unit -> (Pending, buffer) in flight
        self.kept: list[int] = []                         # gathered past forward for reuse, oldest first
        self.live = 0                                     # gathered + in-flight elements
        self.stats = {"demand": 0, "prefetch": 0, "prefetch_used": 0, "max_live": 0, "evicted": 0}
        self.params = engine.params_by_name
        self.pshard = [torch.zeros(n, dtype=dt, device=self.dev) for n in lay.group_local]
        self.flat = []
        for u in lay.units:
            full = torch.zeros(u.padded, dtype=dt, device=self.dev)
            for s in u.slots:
                full[s.offset:s.offset + s.numel].copy_(self.params[s.name].data.reshape(-1))
            if c.size > 1:
                c.broadcast(full, 0, "init broadcast")
            lo, hi = u.shard_range(c.rank)
            self.pshard[u.group][u.local_offset:u.local_offset + u.shard].copy_(full[lo:hi])
        from zero_from_scratch.engine import hpz
        self.hpz = hpz.make(engine)                       # ZeRO++ hpZ (hpz.py), None when off
        self.gathered_units: set[int] = set()
        self.full_of: dict[int, torch.Tensor] = {}        # unit -> its gathered buffer, while gathered
        self.unit_of_storage: dict[int, int] = {}         # that buffer's storage pointer -> unit
        self.calls: dict[int, int] = {}
        self.tag_of = {u.index: u.tag for u in lay.units}
        for s_name, p in self.params.items():
            p.data = torch.empty(0, dtype=dt, device=self.dev)
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
        """Make u's full parameters available now (demand): already there, in flight, or gathered here."""
        if u.index in self.gathered_units:
            if u.index in self.kept:
                self.kept.remove(u.index)                 # in use again: no longer evictable
            return
        if u.index in self.prefetched:
            h, full = self.prefetched.pop(u.index)
            try:
                h.wait()
            except CollectiveError as e:
                raise ZeroDivergenceError(f"rank {self.e.comm.rank}: ZeRO-3 prefetch for {label} failed: {e}") from e
            self.stats["prefetch_used"] += 1
            self._install(u, full)
            return
        self._make_room(u.padded)
        tag = self._check(kind, u, label)
        full = torch.empty(u.padded, dtype=self.e.dtype, device=self.dev)
        self._count_live(u.padded)
        self.stats["demand"] += 1
        with self._tagged(tag, label):
            if not (self.hpz and self.hpz.gather(u, kind, full, tag)):      # hpZ: backward stays in the node
                self.e.comm.all_gather(full, self.param_shard(u), f"param all-gather ({kind})", tag=tag)
                if self.hpz:
                    self.hpz.keep(u, full)
        self._install(u, full)

    def unit(self, i: int):
        """A unit by index: the engine's layout, then (frozen.py) the frozen parameters' units,
        numbered after it; both can be gathered, traced, kept and released."""
        units = self.e.layout.units
        return units[i] if i < len(units) else self.e.frozen.units[i - len(units)]

    def _count_live(self, n: int) -> None:
        self.live += n
        self.stats["max_live"] = max(self.stats["max_live"], self.live)

    def _install(self, u, full: torch.Tensor) -> None:
        for s in u.slots:
            self.params[s.name].data = full[s.offset:s.offset + s.numel].view(s.shape)
        self.gathered_units.add(u.index)
        self.full_of[u.index] = full
        self.unit_of_storage[full.untyped_storage().data_ptr()] = u.index

    def _release(self, u, force: bool = False) -> None:
        if u.index in self.gathered_units and (force or u.index not in self.persistent):
            for s in u.slots:
                self.params[s.name].data = torch.empty(0, dtype=self.e.dtype, device=self.dev)
            self.gathered_units.discard(u.index)
            if u.index in self.kept:
                self.kept.remove(u.index)
            self.live -= u.padded
            full = self.full_of.pop(u.index, None)
            if full is not None:
                self.unit_of_storage.pop(full.untyped_storage().data_ptr(), None)

    def release_all(self) -> None:
        """Drop every gathered copy (after the step or a checkpoint load the shards changed)."""
        self._drop_prefetches()
        for i in list(self.gathered_units):
            self._release(self.unit(i), force=True)

    def _drop_prefetches(self) -> None:
        for i, (h, _) in list(self.prefetched.items()):
            h.wait()
            self.live -= self.unit(i).padded
        self.prefetched.clear()

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
                pos = self._follow_trace("forward", u)
                if pos is not None:
                    self.fwd_pos[u.index] = pos
                self._gather(u, "forward", f"forward of {name!r}")
            self._prefetch()
        return hook

    def _post_forward(self, units):
        def hook(module, args, output):
            for u in units:
                if u.index in self.gathered_units and u.index not in self.persistent and self._reused_soon(u):
                    self.kept.append(u.index)          # its backward comes soon: keep, evictable
                else:
                    self._release(u)
        return hook

    def _pre_backward(self, name, units):
        def hook(module, grad_output):
            for u in units:
                self._follow_trace("backward", u)
                self._gather(u, "backward", f"backward of {name!r}")
            self._prefetch()
        return hook

    # ------------------------------------------------------------------ gradients: reduce when complete
    def _arrived(self, u) -> None:
        self.pending[u.index] -= 1
        if self.pending[u.index] == 0:  # at once, in completion order: module order is checked
            self._reduce(u)

    def _reduce(self, u, tag: int = 0) -> None:
        label = f"gradient reduce-scatter of {u.tag!r}"
        tag = self._check("reduce", u, label)
        with self._tagged(tag, label):
            super()._reduce(u, tag)
        self._release(u)
        if self.hpz:
            self.hpz.release(u)

    def after_backward(self, boundary: bool) -> None:
        for u in self.e.layout.units:    # units with no gradient (unused this micro-batch), in unit order
            if self.pending[u.index] != -1:
                self._reduce(u)
        try:
            self.wait_all()
        except CollectiveError as e:
            raise ZeroDivergenceError(f"rank {self.e.comm.rank}: ZeRO-3 gradient reduce-scatter failed: {e}") from e
        self._drop_prefetches()          # a micro-batch that left the trace may leave some in flight
        for i in list(self.gathered_units):
            self._release(self.unit(i))       # persistent units stay until the step
        if self.in_train and self.trace is None:
            self.trace = self.recording  # the first training micro-batch is the trace
        self.in_train = False
        self.calls.clear()              # call counts restart every micro-batch (same on all ranks)

    def before_backward(self, boundary: bool) -> None:
        self.boundary = boundary
        self.pending = {u.index: len(u.slots) for u in self.e.layout.units}

    def forward_done(self) -> None:
        """Called before each forward: eval / no-grad passes leave no state behind and do not
        follow (or record) the trace."""
        self.in_train = torch.is_grad_enabled()
        if self.in_train:
            self.tpos, self.trace_ok, self.fwd_pos = 0, self.trace is not None, {}
        else:
            self.calls.clear()
            self.trace_ok = False       # eval: release after every module, prefetch nothing

    # ------------------------------------------------------------------ optimizer view
    def param_shard(self, u) -> torch.Tensor:
        return self.pshard[u.group][u.local_offset:u.local_offset + u.shard]

    def after_step(self) -> None:
        if self.hpz:
            self.hpz.clear()            # secondary shards are stale once the weights move
        self.release_all()              # the shards changed: persistent copies are stale

    def after_load(self) -> None:
        if self.hpz:
            self.hpz.clear()
        self.release_all()

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
            for u in units:             # already-gathered (persistent, kept) units are written back too
                if modifier_rank is not None:
                    full = self.write_back(u, modifier_rank)
                    if u not in mine:   # stays gathered: its copy must hold the modifier's values too
                        self._install(u, self.full_of[u.index].copy_(full))
                if u in mine:
                    self._release(u, force=True)
            if modifier_rank is not None:
                self.e.refresh_master()

    def write_back(self, u, modifier_rank: int) -> torch.Tensor:
        """modifier_rank's (possibly edited) full unit → every rank's shard; returns the full unit."""
        c = self.e.comm
        full = torch.empty(u.padded, dtype=self.e.dtype, device=self.dev)
        for s in u.slots:
            full[s.offset:s.offset + s.numel].copy_(self.params[s.name].data.reshape(-1))
        if c.size > 1:
            c.broadcast(full, modifier_rank, "gathered_parameters broadcast")
        lo, hi = u.shard_range(c.rank)
        self.param_shard(u).copy_(full[lo:hi])
        return full

    def memory(self) -> dict:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": nb(self.pshard), "grads": nb(self.gshard)}
