"""engine.coalesce_grad_reduction() (DeepSpeed 0.19.8, runtime/engine.py): the backwards inside a
with-block keep their gradients on this rank; the block's exit reduces them once, before step().

    python -m pytest tests/test_coalesce.py       (2 ranks: against the same run without the block, and one-process torch)

    with engine.coalesce_grad_reduction():
        for mb in micro_batches: engine.backward(engine(mb))
    engine.step()

Stage 1 keeps its full gradient buffer unreduced, as inside no_sync. Stages 2-3 (`Deferred`) keep each
unit's gradient bucket across the block's backwards instead of reduce-scattering it every micro-batch
(DeepSpeed leaves them in param.grad: the same sums, in the same order); the exit reduce-scatters every
unit once, in unit order, as a boundary backward does. DeepSpeed's checks, with its words and types:
managed_gradient_accumulation only, ZeRO stages 1-3, no pipeline, not inside no_sync, no nesting, no
step() inside; the boundary flag the block found is restored on exit.
Cost: stages 2-3 hold the full gradient (Ψ elements, model dtype) for the block's length, as
DeepSpeed's param.grad does; one reduce-scatter of Ψ per block instead of one per backward.
"""
from __future__ import annotations

import contextlib

import torch

from zero_from_scratch.engine.precision import deepspeed_bf16_optimizer


class Deferred:
    """Mixed into stages 2-3: while `coalescing`, completed units wait with their buckets."""
    coalescing = False

    def _arrived(self, u) -> None:
        if self.coalescing:
            self.pending[u.index] -= 1
            return
        super()._arrived(u)

    def after_backward(self, boundary: bool) -> None:
        if self.coalescing:      # nothing reduces now, not even units that got no gradient
            self.pending = dict.fromkeys(self.pending, -1)
        super().after_backward(boundary)


class CoalesceGradReduction:
    """Mixed into ZeroEngine: DeepSpeed's context manager and its two flush methods."""
    pipeline_parallelism = False       # DeepSpeed's name; the pipeline engine refuses the block itself

    @property
    def _is_gradient_accumulation_boundary(self):      # DeepSpeed's name for set_gradient_accumulation_boundary's flag
        return self._boundary_override

    @_is_gradient_accumulation_boundary.setter
    def _is_gradient_accumulation_boundary(self, value) -> None:
        self._boundary_override = value

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        assert self.managed_gradient_accumulation(), \
            "coalesce_grad_reduction is not supported with managed_gradient_accumulation=False; " \
            "the caller already owns the accumulation boundary via step()"
        if self.stage_id not in (1, 2, 3):
            raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {self.stage_id}")
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction is not supported under pipeline parallelism")
        assert not self.inside_no_sync_ctxt, "coalesce_grad_reduction cannot be nested inside another no_sync context"
        if deepspeed_bf16_optimizer(self.config, self.stage_id):
            raise NotImplementedError("coalesce_grad_reduction does not yet support optimizer wrapper BF16_Optimizer "
                                      "(DeepSpeed's, for bf16 with fp32 grad_accum_dtype at stage 1; engine.py)")
        saved = self._boundary_override
        self.inside_no_sync_ctxt = True       # backward_boundary() is False inside: stage 1 keeps its sums local
        self.stage.coalescing = True
        try:
            yield
        finally:
            self.stage.coalescing = False
            self.inside_no_sync_ctxt = False
            self._boundary_override = True
            try:
                flush = self._flush_coalesced_reduction_zero3 if self.stage_id == 3 else \
                    self._flush_coalesced_reduction_zero12
                flush(self.optimizer)
            finally:
                self._boundary_override = saved

    def _flush_coalesced_reduction_zero12(self, optimizer) -> None:
        """The block's one reduction: a boundary backward's, with no gradient left to arrive."""
        self.stage.before_backward(True)
        self.stage.after_backward(True)
        self._grads_local = False
        self._count_micro_step(True)
    _flush_coalesced_reduction_zero3 = _flush_coalesced_reduction_zero12

    def local_grad(self, name: str):
        """This rank's unreduced gradient sum of parameter `name` while _grads_local (stages 0-1 between
        boundaries, stages 2-3 inside a block: its unit's bucket), as DeepSpeed's param.grad there."""
        if self.stage_id < 2:
            return self.stage.gview[name].float() / self.config.reduction.pre
        ui, slot = self.layout.where[name]
        b = self.stage.bucket.get(ui)
        g = torch.zeros(slot.shape, device=self.device) if b is None else b[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return g.float() / self.config.reduction.pre

    def _count_micro_step(self, boundary: bool) -> None:
        """DeepSpeed's optimizer.micro_step_id, as far as ringzero serves it: the backwards whose gradients
        reached the partitions since the last step (every one at stages 2-3 outside a coalesce block, the
        boundary's at stage 1), so 0 at a block's flush. DeepSpeed's starts at -1 at stages 1-2 and counts
        at the next forward at stage 3; only the flush's 0 is DeepSpeed's here."""
        reduced = boundary or self.stage_id >= 2 and not self.stage.coalescing
        self.optimizer.micro_step_id = getattr(self.optimizer, "micro_step_id", 0) + int(reduced)
