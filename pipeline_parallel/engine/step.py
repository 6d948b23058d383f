"""The end of a pipeline step: gradient norm, status all-reduce, clipping, the update in fp32 or
through fp32 masters (bf16 / fp16), the loss scale, and what rank 0 reports.

    (PipelineEngine.step, run by the executor's `step` op on every rank)
    "bf16": {"enabled": true}   or   "fp16": {"enabled": true, "initial_scale_power": 16, "loss_scale_window": 1000}
    "steps_per_print": 10       rank 0: "steps: 10 loss: 2.3456 iter time (s): 0.512 samples/sec: 31.250"

Norm: each parameter once — only dp replica 0 counts (under ZeRO-1 each replica its own slice,
engine/zero1.py), tied copies after the first holder are skipped (DeepSpeed's ds_pipe_replicated),
a tp-replicated parameter counts on tp rank 0 only (mpu.counts_on); the status all-reduce sums
norm² over pp (and tp): the global norm of one process. "pipeline": {"clip_norm": "stage0"} is
DeepSpeed's fp32 pipeline instead: its clip_grad_norm_ (runtime/utils.py) sums only model-parallel
rank 0's norms, which in a pipeline grid is stage 0, in fp32 arithmetic (_deepspeed_fp32_coef); its
AlexNet pipeline example matches to ~1e-6 only with both (clients/pipeline/).

Mixed precision, as DeepSpeed's pipeline engine on an unfused optimizer (torch_adam): stages,
activations, boundaries and gradients in the 16-bit dtype, reduced over dp in it, then copied to
fp32 masters that the optimizer steps and that are copied back (2Ψ + 2Ψ + 4Ψ + K·Ψ bytes). fp16:
the last stage scales each micro-batch's loss by S; the norm is of the gradients ÷ S; one
non-finite value anywhere and every stage skips the step (skipped_steps += 1, no lr step). S follows
DeepSpeed's FP16_UnfusedOptimizer: 2^initial_scale_power, halved on overflow (not below
min_loss_scale, no hysteresis), doubled after loss_scale_window clean steps. bf16: no scale.
Reporting (StepReport): DeepSpeed's train_batch line every steps_per_print steps, and the
tensorboard / csv_monitor tags of the ZeRO engine's writer (monitor.py); it sends nothing.
Cost: one pass over Ψ_stage for the norm, 24 bytes all-reduced, the optimizer's passes; with
masters one elementwise pass each way (grad → master, master → stage); rank 0's file writes.
"""
from __future__ import annotations

import math
import time

import torch

from primitives.log import print0
from zero_from_scratch.engine.comm import Comm
from zero_from_scratch.engine.mixed_cast import cast_model
from zero_from_scratch.engine.monitor import Monitors
from zero_from_scratch.engine.mpu import counts_on
from zero_from_scratch.engine.precision import DynamicLossScaler, StaticLossScaler, model_dtype


def _coef(clip: float, norm: float) -> float:
    """clip_grad_norm_'s factor: clip / (norm + 1e-6), capped at 1 (1 without clipping)."""
    return min(clip / (norm + 1e-6), 1.0) if clip > 0 else 1.0


def take_step(e) -> bool:
    """One optimizer step on engine `e`; False when it was skipped (fp16/bf16 overflow)."""
    ok = not e.failed_locally() and (e.clip_norm == "global" or e.stage == 0)
    if e.zero1 is not None:          # every replica holds its own slice of the averaged gradients
        norm_sq = e.zero1.norm_sq() if ok else 0.0
    else:                            # every replica holds all of them: replica 0 counts
        mine = [p.grad for p in e.params if p.grad is not None and not e.tied.is_replica(p)
                and counts_on(p, e.tp_rank)] if ok and e.dp_rank == 0 else []
        if not mine:
            norm_sq = 0.0
        elif e.clip_norm == "stage0":   # DeepSpeed's arithmetic: an fp32 norm per parameter, their squares summed in fp32
            norm_sq = float(torch.stack([g.float().norm(2) for g in mine]).pow(2).sum())
        else:
            norm_sq = sum(float(g.double().pow(2).sum()) for g in mine)
    e.step_status(norm_sq)
    scale = e.loss_scale
    e.global_grad_norm /= scale
    clip, norm = e.cfg.run.gradient_clipping, e.global_grad_norm
    applied = e.mixed is None or math.isfinite(norm)
    owner = e.zero1 if e.zero1 is not None else e.mixed     # the fp32 copy: ZeRO-1's shard, or the masters
    if owner is not None and not applied:
        owner.skip()
    elif owner is not None:
        owner.step(_coef(clip, norm), scale)
    else:
        coef = _deepspeed_fp32_coef(e, clip) if clip > 0 and e.clip_norm == "stage0" else _coef(clip, norm)
        if torch.is_tensor(coef) or coef < 1:
            for p in e.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        e.optimizer.step()
        e.optimizer.zero_grad(set_to_none=True)
    if e.scaler is not None:
        e.scaler.update_scale(not applied)
    if not applied:
        e.skipped_steps += 1
    elif e.lr_scheduler is not None:
        e.lr_scheduler.step()
    e.global_steps += 1
    e.global_samples += e.micro_batches * e.micro_batch_size * e.dp
    return applied


def _deepspeed_fp32_coef(e, clip: float) -> torch.Tensor:
    """DeepSpeed's clip_grad_norm_ (runtime/utils.py) from stage 0's fp32 norm²: √ in fp32, the average over
    data replicas (each adds norm/dp), clip / (norm + 1e-6) in fp32, capped at 1; every gradient is multiplied."""
    # the all-reduced norm² was stage 0's fp32 sum plus zeros: squaring its double root recovers it exactly in fp32
    total = torch.tensor([e.global_grad_norm ** 2], dtype=torch.float32).pow(0.5)
    part = total * 1.0 / float(e.dp)
    total = part
    for _ in range(e.dp - 1):
        total = total + part
    return torch.min(torch.tensor([1.0]), torch.tensor([float(clip)]) / (total + 1e-6))


def build_scaler(run):
    """fp16's loss scale as DeepSpeed's FP16_UnfusedOptimizer keeps it (runtime/fp16/unfused_optimizer.py:
    no hysteresis, no error at min_loss_scale); None without fp16."""
    f = run.fp16
    if not f.enabled:
        return None
    if f.loss_scale > 0:
        return StaticLossScaler(float(f.loss_scale))
    return DynamicLossScaler(2.0 ** f.initial_scale_power, f.loss_scale_window, f.min_loss_scale, delayed_shift=1,
                             raise_error_at_min_scale=False)


class MixedPrecision:
    """Casts the stage to the 16-bit dtype and keeps the fp32 masters the optimizer steps."""

    def __init__(self, engine, masters: bool = True):
        self.e, self.dtype = engine, model_dtype(engine.cfg.run)
        cast_model(engine.module, engine.cfg.raw, self.dtype)   # parameters only, buffers as loaded (DeepSpeed's)
        self.params = engine.params
        # with ZeRO-1 the fp32 master is the replica's shard (engine/zero1.py): none kept here
        self.master = [p.detach().float().clone() for p in self.params] if masters else []
        self.master_of = {id(p): m for p, m in zip(self.params, self.master)}

    def masters_for(self, model_parameters):
        """The masters of the parameters a client passed (same order), or all of them."""
        if model_parameters is None:
            return None
        return [self.master_of.get(id(p), p) for p in model_parameters]

    def skip(self) -> None:
        """An overflowing step: drop the gradients."""
        for p in self.params:
            p.grad = None

    def step(self, coef: float, scale: float) -> None:
        """Unscale (and clip: coef < 1) into the masters, step, copy back."""
        optimizer = self.e.optimizer
        inv = 1.0 / scale
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


class StepReport:
    def __init__(self, engine):
        self.spp = engine.cfg.run.instruments.get("steps_per_print")
        mons = engine.cfg.run.monitor
        on = any(c.enabled for c in mons.values())
        self.monitors = Monitors(mons, Comm("primitives"), engine.cfg.run.train_batch_size) if on else None
        self.t0 = time.perf_counter()

    def after_step(self, engine, loss: float) -> None:
        now, dt = time.perf_counter(), time.perf_counter() - self.t0
        self.t0 = now
        if self.spp and engine.global_steps % self.spp == 0:
            tput = engine.cfg.run.train_batch_size / dt if dt > 0 else float("inf")
            print0(f"steps: {engine.global_steps} loss: {loss:0.4f} iter time (s): {dt:0.3f} samples/sec: {tput:0.3f}")
        if self.monitors is not None:
            self.monitors.write_step(engine, loss)   # reads DeepSpeed's engine queries (pipe_engine.py)
