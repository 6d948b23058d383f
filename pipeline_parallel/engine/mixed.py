"""bf16 / fp16 for the pipeline engine: low-precision stages, fp32 master weights, fp16 loss scaling.

    "bf16": {"enabled": true}                       or
    "fp16": {"enabled": true, "initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1}

As DeepSpeed's pipeline engine runs them on an unfused optimizer (torch_adam, CPU): each stage's
parameters, activations and boundary messages are in the 16-bit dtype; gradients accumulate in
it over the m micro-batches, are reduced over dp in it, then copied to an fp32 master copy that
the optimizer updates and that is copied back (rounded) into the stage (2Ψ + 2Ψ + 4Ψ + K·Ψ bytes).
fp16: the last stage multiplies each micro-batch's loss by the scale S before backward (so every
stage's gradients and the boundary gradients carry S); the step computes the global norm of the
scaled gradients over all stages — one non-finite value anywhere and every stage skips the step
(the status all-reduce carries the norm), and the lr scheduler does not advance. The scale
follows DeepSpeed's FP16_UnfusedOptimizer._update_scale: 2^initial_scale_power at start, halved
on every overflow (not below min_loss_scale; no hysteresis on this path), doubled after
loss_scale_window clean steps. bf16: no scale; a non-finite gradient skips the step too.
Cost per step: one elementwise pass over Ψ_stage each way (grad → master, master → stage).
"""
from __future__ import annotations

import math

import torch

from zero_from_scratch.engine.precision import model_dtype


class UnfusedScaler:
    """DeepSpeed's FP16_UnfusedOptimizer dynamic loss scale (runtime/fp16/unfused_optimizer.py)."""

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, dynamic: bool = True):
        self.cur_scale, self.scale_window, self.min_scale, self.dynamic = init_scale, scale_window, min_scale, dynamic
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow: bool) -> None:
        if self.dynamic:
            if overflow:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
                self.last_overflow_iter = self.cur_iter
            else:
                stable = (self.cur_iter - self.last_overflow_iter) - 1
                if stable > 0 and stable % self.scale_window == 0:
                    self.cur_scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter")}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)


def build_scaler(run):
    f = run.fp16
    if not f.enabled:
        return None
    if f.loss_scale > 0:
        return UnfusedScaler(float(f.loss_scale), f.loss_scale_window, f.min_loss_scale, dynamic=False)
    return UnfusedScaler(2.0 ** f.initial_scale_power, f.loss_scale_window, f.min_loss_scale)


class MixedPrecision:
    """Casts the stage to the 16-bit dtype and keeps the fp32 masters the optimizer steps."""

    def __init__(self, engine, masters: bool = True):
        self.e, self.dtype = engine, model_dtype(engine.cfg.run)
        engine.module.to(self.dtype)
        self.params = engine.params
        # with ZeRO-1 the fp32 master is the replica's shard (engine/zero1.py): none kept here
        self.master = [p.detach().float().clone() for p in self.params] if masters else []
        self.master_of = {id(p): m for p, m in zip(self.params, self.master)}

    def masters_for(self, model_parameters):
        """The masters of the parameters a client passed (same order), or all of them."""
        if model_parameters is None:
            return None
        return [self.master_of.get(id(p), p) for p in model_parameters]

    def step(self, optimizer, clip: float, norm: float, scale: float) -> bool:
        """Unscale (and clip) into the masters, step, copy back. False: overflow, the step is skipped."""
        if not math.isfinite(norm):
            for p in self.params:
                p.grad = None
            return False
        inv = 1.0 / scale
        if clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1:
                inv *= coef
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float().mul_(inv) if p.grad is not None else None
            p.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        return True
