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
    modifier_rank, that rank's edits are broadcast on exit (and copied into the fp32 master)."""
    yield
    if modifier_rank is not None:
        for buf in stage.flat:
            stage.comm.broadcast(buf, modifier_rank, purpose="gathered_parameters broadcast")
        stage.e.refresh_master()


class ZeroStage1(Stage1):
    def __init__(self, engine):
        self.e, self.overlap = engine, engine.config.zero.overlap_comm and engine.comm.size > 1
        super().__init__(*engine_inputs(engine))
        self.reduce_scatter = engine.config.zero.reduce_scatter

    kw, gathered = labelled, gathered_replicated

    def _reduce_in_backward(self) -> bool:
        return self.overlap and self.boundary

    def after_load(self) -> None:
        pass


class ZeroStage0(Stage0):
    def __init__(self, engine):
        self.e, self.overlap = engine, engine.config.zero.overlap_comm and engine.comm.size > 1
        super().__init__(*engine_inputs(engine))

    kw, gathered = labelled, gathered_replicated

    _reduce_in_backward, after_load = ZeroStage1._reduce_in_backward, ZeroStage1.after_load


class BucketPool:
    """Gradient buckets of up to `cap` elements, handed out and taken back (contiguous_gradients).
    When `limit` buffers exist and none is free, take() waits for the oldest in-flight reduction
    of `stage` (its `then` gives its buffer back)."""

    def __init__(self, stage, cap: int, contiguous: bool, limit: int):
        self.stage, self.cap, self.contiguous, self.limit = stage, cap, contiguous, limit
        self.free: list[torch.Tensor] = []
        self.base_of: dict[int, torch.Tensor] = {}        # unit -> the buffer its bucket is a view of
        self.size = self.allocs = 0

    def take(self, u) -> torch.Tensor:
        st = self.stage
        if not self.contiguous:
            self.allocs += 1
            return torch.zeros(u.padded, dtype=st.dtype, device=st.dev)
        while not self.free and st.inflight and self.size >= self.limit:
            st._wait_oldest()
        if not self.free:
            self.free.append(torch.empty(self.cap, dtype=st.dtype, device=st.dev))
            self.size += 1
            self.allocs += 1
        base = self.base_of[u.index] = self.free.pop()
        return base[:u.padded].zero_()

    def give_back(self, u) -> None:
        base = self.base_of.pop(u.index, None)
        if base is not None:
            self.free.append(base)


def make_pool(stage, engine) -> BucketPool:
    cap = max((u.padded for u in engine.layout.units), default=0)
    return BucketPool(stage, cap, engine.config.zero.contiguous_gradients, 2 if stage.overlap else 1)


class ZeroStage2(Stage2):
    def __init__(self, engine):
        self.e, self.overlap = engine, engine.config.zero.overlap_comm and engine.comm.size > 1
        self.pool = make_pool(self, engine)
        super().__init__(*engine_inputs(engine))
        self.reduce_scatter = engine.config.zero.reduce_scatter

    kw, gathered = labelled, gathered_replicated

    def _new_bucket(self, u) -> torch.Tensor:
        return self.pool.take(u)

    def _bucket_done(self, u, b) -> None:
        self.pool.give_back(u)

    after_load = ZeroStage1.after_load
