"""The engine's ZeRO-0/1/2: the textbook stages (stage1.py, stage2.py) built from an engine's
config, with labelled, asynchronous collectives and pooled gradient buckets.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 2 --zero overlap_comm=true

overlap_comm: a unit's reduction starts, from the gradient hook that completes it (in unit order,
so every rank issues the same sequence), on the engine's communication thread (comm.py), and
backward goes on computing earlier layers; after_backward waits for all of them. Stage 1 does
this on the boundary micro-batch only (accumulation needs no communication). Same bytes, same
bits: only *when* they move changes.
reduce_scatter: false all-reduces each unit instead (2× the bytes, the owner's block is the same).
contiguous_gradients (`BucketPool`): true = bucket buffers are preallocated (the largest unit) and
reused: one, or two with overlap_comm (one fills while the other is on the wire; when both are
busy the hook waits for the older one, as DeepSpeed's double ipg buffer does); more only when
backward interleaves buckets. false = a fresh buffer per bucket. Neither changes a bit of the
result; `pool.allocs` counts the allocations.
"""
from __future__ import annotations

import contextlib

import torch

from zero_from_scratch.engine.coalesce import Deferred
from zero_from_scratch.engine.moe_grads import ExpertUnits
from zero_from_scratch.engine.precision import grad_dtype
from zero_from_scratch.stage1 import Stage0, Stage1
from zero_from_scratch.stage2 import Stage2


def labelled(stage, purpose: str, u=None, tag: int = 0) -> dict:
    """The engine Comm's keywords for one collective: the ledger's label (purpose, and the unit's
    tag as `what`), async_op for gradient reductions under overlap_comm, the divergence tag."""
    kw = {"purpose": purpose}
    if u is not None:
        kw["what"] = u.tag
    if purpose.startswith("grad ") and stage.overlap:
        kw["async_op"] = True
    if tag:
        kw["tag"] = tag
    return kw


def engine_inputs(engine) -> tuple:
    return engine.comm, engine.layout, engine.params_by_name, engine.dtype, engine.device


@contextlib.contextmanager
def gathered_replicated(stage, params, modifier_rank=None):
    """gathered_parameters at stages 0-2: the full parameters are there already; with
    modifier_rank, that rank's edits are broadcast on exit (and copied into the fp32 master).
    Expert units (engine.expert_comms, ep_size > 1) are not broadcast: each rank holds other experts
    at the same offsets, and keeps its own, as DeepSpeed's GatheredParameters does nothing below ZeRO-3."""
    yield
    if modifier_rank is not None:
        experts = getattr(stage.e, "expert_comms", {})
        if not experts:
            for buf in stage.flat:
                stage.comm.broadcast(buf, modifier_rank, purpose="gathered_parameters broadcast")
        for u in stage.layout.units if experts else ():
            if u.index not in experts:
                buf = stage.flat[u.group][u.flat_offset:u.flat_offset + u.padded]
                stage.comm.broadcast(buf, modifier_rank, purpose="gathered_parameters broadcast")
        stage.e.refresh_master()


class TimedWait:
    """The textbook's wait for the oldest asynchronous reduction, timed by the engine's Comm first
    (how long it blocks is that call's exposed communication; then() is not counted)."""

    def _wait_oldest(self) -> None:
        self.comm.wait(self.inflight[0][0])
        super()._wait_oldest()


class Labelled(TimedWait):
    """The engine's keywords on every collective of a stage (labelled), its gathered_parameters."""
    gathered = gathered_replicated

    def kw(self, purpose: str, u=None) -> dict:
        return {**super().kw(purpose, u), **labelled(self, purpose, u)}

    def after_load(self) -> None:
        pass


class Overlapped(Labelled):
    """Stages 0 and 1 under overlap_comm: the boundary micro-batch reduces from the gradient hooks."""

    def _reduce_in_backward(self) -> bool:
        return super()._reduce_in_backward() or (self.overlap and self.boundary)


class Fp32Accumulated:
    """data_types.grad_accum_dtype fp32 under bf16 (precision.grad_dtype): the gradient buffers (stage 1's
    full one, stage 2's shard) are fp32, so each micro-batch's bf16 gradient is added in fp32; buckets
    and the reduction stay bf16, as DeepSpeed's communication_data_type (engine.py allreduce_bucket;
    stage_1_and_2.py average_tensor)."""

    def _make_grad_storage(self) -> None:
        model, self.dtype = self.dtype, self.grad_dtype    # the textbook allocates in self.dtype
        try:
            super()._make_grad_storage()
        finally:
            self.dtype = model


class ZeroStage1(ExpertUnits, Fp32Accumulated, Overlapped, Stage1):
    def __init__(self, engine):
        self.e, self.overlap = engine, engine.config.zero.overlap_comm and engine.comm.size > 1
        self.grad_dtype = grad_dtype(engine.config, engine.stage_id)
        super().__init__(*engine_inputs(engine))
        self.reduce_scatter = engine.config.zero.reduce_scatter

    def _reduce(self, u) -> None:
        """fp32 sums: reduced as a bf16 copy, the result copied back (DeepSpeed's BF16_Optimizer
        gradients through engine.allreduce_bucket, cast to communication_data_type)."""
        if self.grad_dtype == self.dtype:
            return super()._reduce(u)
        acc = self._unit_grad(u)
        b = acc.to(self.dtype)
        lo, hi = u.shard_range(self.rank) if self.reduce_scatter else (0, u.padded)
        self._sum_into_block(b, u, lambda: acc[lo:hi].copy_(b[lo:hi]))
        self.pending[u.index] = -1


class ZeroStage0(ExpertUnits, Overlapped, Stage0):
    def __init__(self, engine):
        self.e, self.overlap = engine, engine.config.zero.overlap_comm and engine.comm.size > 1
        super().__init__(*engine_inputs(engine))


class BucketPool:
    """Gradient buckets, handed out and taken back (contiguous_gradients). Stage 2's buckets are
    alike (reduce_bucket_size), so each buffer holds `cap` elements, the largest; ZeRO-3's units
    differ by module (a vocabulary embedding is many times a layer), so with `exact` a buffer has
    its unit's size and is reused by units of that size: the largest exists only while its unit
    reduces. When `limit` buffers are in use and none fits, take() waits for the oldest in-flight
    reduction of `stage` (its `then` gives its buffer back): one, or two under overlap_comm."""

    def __init__(self, stage, engine, exact: bool = False):
        self.stage, self.contiguous, self.exact = stage, engine.config.zero.contiguous_gradients, exact
        self.cap = max((u.padded for u in engine.layout.units), default=0)
        self.limit = 2 if stage.overlap else 1
        self.free: dict[int, list[torch.Tensor]] = {}    # buffer size -> idle buffers
        self.base_of: dict[int, torch.Tensor] = {}        # unit -> the buffer its bucket is a view of
        self.size = self.allocs = 0

    def take(self, u) -> torch.Tensor | None:
        """A zeroed view of a pooled buffer; None (counted) when not contiguous: the stage allocates."""
        st = self.stage
        if not self.contiguous:
            self.allocs += 1
            return None
        n = u.padded if self.exact else self.cap
        while not self.free.get(n) and st.inflight and len(self.base_of) >= self.limit:
            st._wait_oldest()
        if not self.free.get(n):
            self.free.setdefault(n, []).append(torch.empty(n, dtype=st.dtype, device=st.dev))
            self.size += 1
            self.allocs += 1
        base = self.base_of[u.index] = self.free[n].pop()
        return base[:u.padded].zero_()

    def give_back(self, u) -> None:
        base = self.base_of.pop(u.index, None)
        if base is not None:
            self.free.setdefault(base.numel(), []).append(base)

    def clear(self) -> None:
        """Free the idle buffers (the next backward allocates again)."""
        self.size -= sum(len(b) for b in self.free.values())
        self.free = {}


class Pooled(Deferred):
    """Stages 2 and 3: gradient buckets from the stage's BucketPool (`self.pool`); kept across the
    backwards of engine.coalesce_grad_reduction() (coalesce.py)."""

    def _new_bucket(self, u) -> torch.Tensor:
        b = self.pool.take(u)
        return super()._new_bucket(u) if b is None else b

    def _bucket_done(self, u, b) -> None:
        super()._bucket_done(u, b)
        self.pool.give_back(u)


class ZeroStage2(ExpertUnits, Fp32Accumulated, Pooled, Labelled, Stage2):
    def __init__(self, engine):
        self.e, self.overlap = engine, engine.config.zero.overlap_comm and engine.comm.size > 1
        self.grad_dtype = grad_dtype(engine.config, engine.stage_id)
        self.pool = BucketPool(self, engine)
        super().__init__(*engine_inputs(engine))
        self.reduce_scatter = engine.config.zero.reduce_scatter
