"""The accumulation boundary, DeepSpeed 0.19.8's two ways (runtime/engine.py), and the plain
`loss.backward()` the engine serves beside engine.backward(loss).

    python -m pytest tests/test_user_backward.py          (2 ranks, against one-process torch)

    for mb in batches: engine.backward(engine(mb)); engine.step()        # managed (DeepSpeed's default)
    {"managed_gradient_accumulation": false}:
    for mb in batches: engine.backward(engine(mb))                       # any number of backwards,
    engine.step()                                                        # then one step: the boundary
    engine.scale(engine(mb)).backward(); engine.step()                   # a plain backward

managed: the micro-step counter decides; every gradient_accumulation_steps-th step() updates (or the
client's set_gradient_accumulation_boundary). unmanaged: the caller's step() is the boundary.
backward() only accumulates: stages 0-1 keep the rank's own sum (nothing leaves the rank), stages 2-3
reduce-scatter every micro-batch into the gradient shards, as always; step() reduces what stages 0-1
kept and updates. is_gradient_accumulation_boundary() is True only while step() runs, and
global_samples grows by micro-batch × the engine.backward calls since the last step. DeepSpeed's checks, with
its words: overlap_comm only at stages 2-3, no pipeline (pipeline_parallel/engine/config.py), and
set_gradient_accumulation_boundary / coalesce_grad_reduction (coalesce.py) are assertion errors.
Cost: none beyond the managed boundary (the same one reduction per step).

A plain backward (DeepSpeed's torch-style backward): forward puts a hook on each output tensor. In a
backward engine.backward did not start, the first hook to fire runs the stage's before_backward and
queues its after_backward (the reductions) at the end of autograd's graph task, and each hook
multiplies its output's gradient by grad_keys' `pre` / gradient_accumulation_steps, as DeepSpeed's
_backward_prologue_per_tensor divides by the latter (DeepSpeed's quirk, kept: an output computed from
another, a model's loss from its logits, is divided on both hooks when gradient_accumulation_steps > 1).
scale(loss) multiplies by the loss scale; with fp16's dynamic scaler a plain backward without it
raises DeepSpeed's RuntimeError. Under torch.func (grad, vmap, jacrev) the hooks leave the gradient
alone, as DeepSpeed's do. The runner, as DeepSpeed at ZeRO-0 (its optimizer is no ZeROOptimizer),
refuses a plain backward at stage 0 with DeepSpeed's RuntimeError (_support_torch_style_backward).
"""
from __future__ import annotations

import contextlib

import torch

from zero_from_scratch.engine import z3_outputs

TORCH_STYLE = ("Direct calls to tensor.backward() are not supported in this configuration. This occurs when either: "
               "(1) your PyTorch version lacks required internal APIs, or (2) using ZeRO stage 0. "
               "Please use engine.backward(loss) instead.")
LOSS_SCALING = ("Loss scaling is required for this configuration, but backward() was called directly without scaling "
                "the loss. Please use one of the following: 1. engine.backward(loss) 2. engine.scale(loss).backward()")


def check_config(config) -> None:
    """DeepSpeed's _do_sanity_check for managed_gradient_accumulation=False (its words, AssertionError)."""
    if not config.raw.get("managed_gradient_accumulation", True):
        assert config.zero.stage >= 2 or not config.zero.overlap_comm, \
            "managed_gradient_accumulation=False supports ZeRO overlap_comm only with ZeRO stage 2"


class _ZeroKind(type):
    def __instancecheck__(cls, obj) -> bool:
        engine = getattr(getattr(obj, "engine_backward", None), "__self__", None)
        return engine is not None and engine.stage_id > 0


class ZeROOptimizer(metaclass=_ZeroKind):
    """deepspeed.runtime.base_optimizer.ZeROOptimizer under the runner: isinstance holds for the engine's
    optimizer where DeepSpeed's is one: stages 1-3 (at stage 0 its FP16_Optimizer / FP16_UnfusedOptimizer, in
    bf16 too, is none; only its pipeline engine's BF16_Optimizer is, and that engine is not this one)."""


class AccumulationBoundary:
    """Mixed into ZeroEngine: DeepSpeed's boundary API, the unmanaged step, scale() and the plain backward."""
    _running_engine_step = False      # DeepSpeed's name: True only while step() runs (the unmanaged boundary)
    _unmanaged_backward_count = 0     # engine.backward calls since the last step (unmanaged)
    _engine_backward = False          # engine.backward is running: it scaled the loss and drives the stage itself
    _plain = None                     # the boundary of the plain backward in flight
    _manual_backward_expected = False  # DeepSpeed's name: scale() was called since the last plain backward
    _support_torch_style_backward = True  # DeepSpeed's name; the runner: False at stage 0 (not a ZeROOptimizer)
    global_samples = 0

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def managed_gradient_accumulation(self):
        return self.config.raw.get("managed_gradient_accumulation", True)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:       # set_gradient_accumulation_boundary
            return self._boundary_override
        if not self.managed_gradient_accumulation():
            return self._running_engine_step
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed: the client says whether the next backward ends the accumulation; until it
        calls this, the micro-step counter decides. Managed mode only (DeepSpeed asserts)."""
        assert self.managed_gradient_accumulation(), \
            "set_gradient_accumulation_boundary() is not supported with managed_gradient_accumulation=False; " \
            "the caller owns the boundary by calling step()"
        self._boundary_override = bool(is_boundary)

    def backward_boundary(self) -> bool:
        """Whether this backward reduces: at the accumulation boundary and outside no_sync."""
        boundary = self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt
        self._grads_local = not boundary and (self.stage_id < 2 or self.stage.coalescing)
        return boundary

    def check_step(self) -> None:
        if self.inside_no_sync_ctxt:
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")

    # ------------------------------------------------------------------ engine.backward / step wrap these
    @contextlib.contextmanager
    def engine_backward(self):
        """Around engine.backward's autograd call: the output hooks leave it alone; unmanaged, it is counted."""
        if not self.managed_gradient_accumulation():
            self._unmanaged_backward_count += 1
        self._engine_backward = True
        try:
            yield
        finally:
            self._engine_backward = False

    @contextlib.contextmanager
    def boundary_step(self):
        """Around step(): unmanaged, step() is the boundary; stages 0-1 reduce what the backwards kept."""
        self._running_engine_step = True
        try:
            if not self.managed_gradient_accumulation() and self.stage_id < 2:
                self.stage.before_backward(True)
                self.stage.after_backward(True)       # every unit's rank-local sum, reduced now
                self._grads_local = False
            yield
        finally:
            self._running_engine_step = False

    def samples_this_step(self) -> int:
        """DeepSpeed's global_samples increment: train_batch_size, or unmanaged the micro-batches backed."""
        if self.managed_gradient_accumulation():
            return self.config.train_batch_size
        n, self._unmanaged_backward_count = self._unmanaged_backward_count, 0
        return self.config.train_batch_size // self.gradient_accumulation_steps() * n

    # ------------------------------------------------------------------ the plain backward
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's engine.scale: the loss × the loss scale, for a plain loss.backward()."""
        assert isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None, \
            "loss must be a scalar tensor with grad_fn. For non-scalar tensors, use tensor.backward(grad)"
        self._manual_backward_expected = True
        s = self.loss_scaler.loss_scale
        return loss * s if s != 1.0 else loss

    def watch_outputs(self, out):
        """forward's outputs, each tensor autograd will differentiate hooked (DeepSpeed's output hooks)."""
        if torch.is_grad_enabled():
            for t in z3_outputs.tensors(out):
                if t.grad_fn is not None:
                    t.register_hook(self._output_grad)
        return out

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self._engine_backward or torch._C._functorch.peek_interpreter_stack() is not None:
            return grad                                # torch.func.grad & co: no prologue, as DeepSpeed's
        if not self._support_torch_style_backward:
            raise RuntimeError(TORCH_STYLE)            # the runner at stage 0, as DeepSpeed's _backward_prologue
        if self._plain is None:                       # the first output of this backward: the prologue
            self._plain = self.backward_boundary()
            self.stage.before_backward(self._plain)
            torch.autograd.Variable._execution_engine.queue_callback(self._plain_epilogue)
        f = self.config.reduction.pre / self.gradient_accumulation_steps()
        return grad if f == 1.0 else grad * f

    def _plain_epilogue(self) -> None:
        """Autograd ran every gradient hook of the plain backward: the stage's after_backward (DeepSpeed's
        _backward_post_hook → _backward_epilogue)."""
        boundary, self._plain = self._plain, None
        if self.loss_scaler.dynamic and not self._manual_backward_expected:
            raise RuntimeError(LOSS_SCALING)
        self._manual_backward_expected = False
        self._after_backward(boundary)

    def _after_backward(self, boundary: bool) -> None:
        """The end of every backward, engine.backward's and a plain loss.backward()'s alike."""
        self.stage.after_backward(boundary)
        self._count_micro_step(boundary)   # coalesce.py
        self.frozen.after_backward()
