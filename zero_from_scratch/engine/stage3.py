"""The engine's ZeRO-3: the textbook Stage3 (zero_from_scratch/stage3.py) plus what DeepSpeed's
stage3_* keys, ZeRO++ hpZ and a safe failure add, each an object of its own.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 3 --zero overlap_comm=true

  prefetch, reuse, live cap   Prefetcher (prefetch.py): the traced module order
  persistence                 units ≤ stage3_param_persistence_threshold: kept gathered, again after a step, load, save;
                              not one only a script's GatheredParameters reads (DeepSpeed: all of them; saved.py)
  hpZ                         HpZ (hpz.py): the backward all-gather stays inside a node
  qwZ, qgZ                    QwZ (qwz.py): int8 weight all-gathers; QgZ (qgz.py): int4 gradient all-to-alls
  backward gather             on the module's outputs, as DeepSpeed places it (z3_outputs.py)
  saved weights               SavedByReference (saved.py): autograd keeps (unit, view), so a release frees
  divergence                  DivergenceCheck (divergence.py): every collective carries (kind, unit,
                              call#); ranks that ran different modules raise ZeroDivergenceError
  buffers                     Pool (pools.py): gathered units reused within a step; allocator.py: the
                              one process-wide setting, announced; report.py: what each key allows
  offload_param               ParamStore (param_offload.py): shards on the host or in files, read
                              into the all-gather's own buffer; nvme optimizer: gradient shards too
"""
from __future__ import annotations

import contextlib
import functools

import torch

from primitives import CollectiveError
from zero_from_scratch.engine import allocator, hpz, param_offload, qgz, qwz, report, tied, z3_ds_tensor, z3_outputs, zero_partition as zp
from zero_from_scratch.engine.divergence import DivergenceCheck, ZeroDivergenceError
from zero_from_scratch.engine.pools import Pool
from zero_from_scratch.engine.prefetch import Prefetcher
from zero_from_scratch.engine.saved import SavedByReference
from zero_from_scratch.engine.stages import BucketPool, Pooled, TimedWait, engine_inputs, labelled
from zero_from_scratch.stage3 import Stage3


FORCED = ("gather_ctx", "evict", "step")     # releases that drop even persistent and pinned units


class ZeroStage3(Pooled, TimedWait, Stage3):
    def __init__(self, engine):
        z, c = engine.config.zero, engine.comm
        allocator.map_large_blocks()                       # before any unit is built (allocator.py)
        self.e, self.overlap, self.tag = engine, z.overlap_comm and c.size > 1, 0
        self.pool = BucketPool(self, engine, exact=True)
        self.pool.limit = 1 if param_offload.grads_go_to_files(engine) else self.pool.limit  # waited for at once
        self.units_pool = Pool("gathered units", engine.dtype, engine.device)   # every gathered unit's buffer
        self.pf = Prefetcher(self.unit, z.stage3_prefetch_bucket_size if self.overlap else 0,
                             z.stage3_max_live_parameters, z.stage3_max_reuse_distance)
        self.persistent = {u.index for u in engine.layout.units if u.numel <= z.stage3_param_persistence_threshold}
        self.tag_of = {u.index: u.tag for u in engine.layout.units}
        self.check = DivergenceCheck(c, self.tag_of)
        self.saved = SavedByReference(self)
        self.pinned, self.dangling = {}, set()   # external.py: unit -> users mid-forward; returned params' units (to the step)
        super().__init__(*engine_inputs(engine), engine.module)
        self.hpz = hpz.make(engine)                       # ZeRO++ hpZ, None when off
        self.qwz, self.qgz = qwz.make(self, engine), qgz.make(self, engine)   # ZeRO++ qwZ, qgZ, None when off
        self.poff = param_offload.make(self)              # offload_param (the shards built here), None when off
        self.goff = param_offload.make_grads(self)        # gradient shards in files (nvme optimizer offload)
        self.tied = tied.make(self, engine.module)        # each use of a shared parameter straight to its bucket
        allocator.release_freed()                         # the model's full tensors are gone (allocator.py)
        report.announce(engine.config, engine.layout)    # what each stage-3 key allows, when a user sets one

    def kw(self, purpose: str, u=None) -> dict:
        return {**super().kw(purpose, u), **labelled(self, purpose, u, self.tag)}

    def _make_param_storage(self) -> None:
        if getattr(self.e.config, "offload_param", None) is None:
            super()._make_param_storage()
            zp.adopt(self.e, self.layout.units, self.params, stage=self)   # ds_tensor: views of these shards
        else:   # param_offload.make writes each unit's block (_unit_block) straight into its store: no Ψ/N here
            self.flat, self.pshard = [], [torch.empty(0, dtype=self.dtype, device=self.dev)
                                          for _ in self.layout.group_local]

    def _unit_block(self, u) -> torch.Tensor:
        """The textbook's (rank 0's unit, broadcast), or zero.Init's shards gathered one at a time (zero_partition.py)."""
        held = any(zp.held_by_init(self.params[s.name]) for s in u.slots)
        return zp.unit_block(self, u) if held else super()._unit_block(u)
    stats = property(lambda self: self.pf.stats)

    def unit(self, i: int):
        """A unit by index: the layout's, then the frozen parameters' (frozen.py), numbered after it."""
        n = len(self.layout.units)
        return super().unit(i) if i < n else self.e.frozen.units[i - n]

    def param_shard(self, u) -> torch.Tensor:
        poff = getattr(self, "poff", None)                # None while the textbook builds the shards
        return poff.shard(u) if poff and poff.owns(u) else super().param_shard(u)

    def _make_grad_storage(self) -> None:
        if not param_offload.grads_go_to_files(self.e):
            return super()._make_grad_storage()
        # they live in files (param_offload.make_grads): Stage2's two fields, no Ψ/N buffer allocated
        self.gshard, self.bucket = [torch.empty(0, dtype=self.dtype, device=self.dev) for _ in self.layout.group_local], {}

    def grad_shard(self, u) -> torch.Tensor:
        goff = getattr(self, "goff", None)
        return goff.shard(u) if goff else super().grad_shard(u)

    def zero_grad(self) -> None:
        self.goff.zero_all() if getattr(self, "goff", None) else super().zero_grad()

    # ------------------------------------------------------------------ gather / release
    def _gather(self, u, kind: str, label: str) -> None:
        z3_ds_tensor.check_bound(self.params, u)          # each use: a rebound p.ds_tensor is not what is gathered
        if u.index in self.pf.kept:
            self.pf.kept.remove(u.index)                  # in use again: not evictable
        self.saved.read_by(u, kind)                       # the model's forward: persistent as DeepSpeed's again
        if u.index in self.full_of or u.index in self.pf.prefetched:
            return super()._gather(u, kind, label)
        self.pf.make_room(u.padded, lambda v: self._release(v, "evict"))
        self.tag = self.check.count(kind, u, label)
        self.pf.count_live(u.padded)
        self.pf.stats["demand"] += 1
        try:
            with self.check.tagged(self.tag, label):
                super()._gather(u, kind, label)
        finally:
            self.tag = 0

    def _fetch(self, u, kind: str) -> torch.Tensor:
        """The prefetched buffer once done; else qwZ, hpZ (backward inside the node) or the textbook's all-gather."""
        if u.index in self.pf.prefetched:
            wait, full = self.pf.prefetched.pop(u.index)
            try:
                wait()
            except CollectiveError as e:
                raise ZeroDivergenceError(f"rank {self.rank}: ZeRO-3 prefetch for {kind} of {u.tag!r} failed: {e}") from e
            self.pf.stats["prefetch_used"] += 1
            return full
        if (self.qwz and kind in qwz.KINDS) or (self.hpz and self.hpz.has(u, kind)):
            full = self._empty_unit(u)
            if self.qwz and kind in qwz.KINDS:
                self.qwz.fetch(u, kind, full)
            else:
                self.hpz.gather(u, kind, full, self.tag)
            return full
        if self.poff is not None and self.poff.owns(u):
            full, mine = self._read_shard(u)
            self.comm.all_gather_single(full, mine, **self.kw(f"param all-gather ({kind})", u))
        else:
            full = super()._fetch(u, kind)
        if self.hpz:                     # with offload_param "cpu" too: in host memory, where DeepSpeed keeps it
            self.hpz.keep(u, full)
        return full

    def _start_prefetch(self, u, kind: str):
        tag = self.check.count(kind, u, f"prefetch for {kind} of {u.tag!r}")
        if self.qwz:
            return self.qwz.start(u, kind, tag)
        full, mine = self._read_shard(u) if self.poff is not None and self.poff.owns(u) else (self._empty_unit(u), None)
        h = self.hpz.gather(u, kind, full, tag, async_op=True) if self.hpz else None   # backward: in the node
        if h is not None:
            return functools.partial(self.comm.wait, h), full
        h = self.comm.all_gather_single(full, self.param_shard(u) if mine is None else mine, purpose=f"param all-gather ({kind})", tag=tag,
                                        async_op=True, what=u.tag)
        return functools.partial(self.comm.wait, h, *([lambda: self.hpz.keep(u, full)] if self.hpz else [])), full

    def _read_shard(self, u) -> tuple:
        """(a unit buffer, its block holding this rank's offloaded shard): the all-gather runs in place."""
        full = self._empty_unit(u)
        lo, hi = u.shard_range(self.rank)
        self.poff.read_into(u, full[lo:hi])
        return full, full[lo:hi]

    def _empty_unit(self, u) -> torch.Tensor:
        """A free pooled buffer of u's size, else the textbook's new one (kept by the pool after)."""
        return self.units_pool.take(u.padded, lambda: super(ZeroStage3, self)._empty_unit(u))

    def _install(self, u, full: torch.Tensor) -> None:
        super()._install(u, full)
        self.saved.add(u.index, full)

    def _release(self, u, kind: str) -> None:
        """A unit the trace reuses soon is kept after forward (evictable); persistent, pinned ones until FORCED."""
        if u.index not in self.full_of or (kind == "gather_ctx" and self.saved.grad_due(u)) or self.saved.recomputed(kind):
            return                             # the latter two: released by its reduce or backward's end (saved.py)
        if kind == "forward" and u.index not in self.persistent and (self.pf.reused_soon(u) or self.pf.passed_later_use(u)):
            self.pf.kept.append(u.index)       # its backward comes soon (or a prefetch passed it): keep, evictable
            return
        if kind in FORCED or self.saved.released_late(u) or not (u.index in self.persistent or self.pinned.get(u.index) or u.index in self.dangling):
            if u.index in self.pf.kept:
                self.pf.kept.remove(u.index)
            self.pf.live -= u.padded
            full = self.full_of[u.index]
            self.saved.remove(full)
            super()._release(u, kind)
            self.units_pool.give(full)           # reused by the next gather unless something kept it

    def release_all(self, keep_persistent: bool = False) -> None:
        """Drop every gathered copy (the shards changed); keep_persistent: engine.destroy, as DeepSpeed's."""
        self.pf.drop(self.units_pool.give)
        for i in [i for i in self.full_of if not (keep_persistent and i in self.persistent)]:
            self._release(self.unit(i), "step")

    # ------------------------------------------------------------------ the hooks follow the trace
    def add_module_hooks(self, name: str, m, units: list) -> None:
        super().add_module_hooks(name, m, units)          # the textbook's; its full backward pre-hook becomes
        self.hooks[-1].remove()                           # ours on the outputs, as DeepSpeed's (z3_outputs.py)
        self.hooks[-1] = m.register_forward_hook(z3_outputs.before_backward(self._pre_backward(name, units)))

    def _pre_forward(self, name, units):
        return self._following("forward", units, super()._pre_forward(name, units))

    def _pre_backward(self, name, units):
        return self._following("backward", units, super()._pre_backward(name, units))

    def _following(self, kind: str, units, gather):
        """The textbook's gather hook, walking the trace first and prefetching after."""
        def hook(module, *args):
            for u in units:
                self.pf.follow(kind, u)
            gather(module, *args)
            self.pf.prefetch(self.full_of, self._start_prefetch)
        return hook

    # ------------------------------------------------------------------ gradients
    def _reduce(self, u) -> None:
        label = f"gradient reduce-scatter of {u.tag!r}"
        self.tag = self.check.count("reduce", u, label)
        try:
            with self.check.tagged(self.tag, label):
                super()._reduce(u)
                if self.goff:
                    self.wait_all()      # the sum has landed in its shard's buffer: to its file now
                    self.goff.flush(keep=True)
        finally:
            self.tag = 0
        if self.hpz:
            self.hpz.release(u)

    def _sum_into_block(self, b: torch.Tensor, u, then=None) -> None:
        if self.qgz is None:
            return super()._sum_into_block(b, u, then)
        h, finish = self.qgz.reduce(b, u, self.overlap)             # overlap_comm: asynchronous (qgz.py)
        self._launch(h, (lambda: (finish(), then and then())) if h is not None else then)

    def after_backward(self, boundary: bool) -> None:
        try:
            super().after_backward(boundary)
        except CollectiveError as e:
            raise ZeroDivergenceError(f"rank {self.rank}: ZeRO-3 gradient reduce-scatter failed: {e}") from e
        self.pf.drop(self.units_pool.give)                   # a micro-batch that left the trace may leave some in flight
        if allocator.maps():                                 # idle until the next forward / backward (allocator.py)
            self.pool.clear()
            self.units_pool.clear()
        self.pf.finish_backward()
        self.tied and self.tied.after_backward()
        self.check.restart()             # call counts restart every micro-batch (same on all ranks)

    def forward_done(self) -> None:
        """Called before each forward: eval / no-grad passes leave no state behind."""
        if self.poff:
            self.poff.flush()            # shards a writer touched since (load, modifier_rank) go back
        self.tied and self.tied.restore()   # a forward that raised left its aliases
        self.pf.start_forward(torch.is_grad_enabled(), self.full_of, self._start_prefetch)
        if not self.pf.in_train:
            self.check.restart()

    # ------------------------------------------------------------------ optimizer, checkpoints, users
    def after_step(self) -> None:
        super().after_step()
        z3_ds_tensor.drop_kept(self)     # after a load too: the shards are the fp32 masters again
        self.hpz and self.hpz.clear()    # secondary shards are stale once the weights move
        if self.poff:
            self.poff.flush()            # the stepped shards go back to the host / files
        self.release_all()               # the shards changed: persistent copies are stale, and are gathered again
        self.gather_persistent("step")   # at once, as DeepSpeed's stage3.py::_post_step and its load
        allocator.release_freed()        # this step's activations and gradients, freed into the heap
    after_load = after_step

    def gather_persistent(self, after: str = "save") -> None:   # after a save: checkpoint_event_epilogue
        for i in sorted(self.persistent - set(self.full_of) - self.saved.script_read):   # see saved.released_late
            self._gather(self.unit(i), "forward", f"persistent parameters after the {after}")

    @contextlib.contextmanager
    def gathered(self, params, modifier_rank=None):
        """Full `params` inside the block (all ranks enter it); modifier_rank's edits go back to every shard."""
        wanted = {id(p) for p in params}
        units = [u for u in self.layout.units if any(id(self.params[s.name]) in wanted for s in u.slots)]
        with super().gathered(units), self.saved.suspended():   # saved as DeepSpeed saves (saved.py)
            try:
                yield
            finally:
                if modifier_rank is not None:
                    for u in units:          # already-gathered (persistent, kept) units are written back too
                        full = self.write_back(u, modifier_rank)
                        self.full_of[u.index].copy_(full)    # a unit that stays gathered holds the edit too
                    z3_ds_tensor.refresh_units(self.e, units)   # these units' masters only, as the docstring says

    def write_back(self, u, modifier_rank: int) -> torch.Tensor:
        """modifier_rank's (possibly edited) full unit → every rank's shard; returns the full unit."""
        full = torch.empty(u.padded, dtype=self.dtype, device=self.dev)
        for s in u.slots:
            full[s.offset:s.offset + s.numel].copy_(self.params[s.name].data.reshape(-1))
        if self.comm.size > 1:
            self.comm.broadcast(full, modifier_rank, purpose="gathered_parameters broadcast")
        lo, hi = u.shard_range(self.rank)
        self.param_shard(u).copy_(full[lo:hi])
        return full
