"""The end of a pipeline step: gradient norm, status all-reduce, clipping, the update in fp32 or
through fp32 masters (bf16 / fp16), the loss scale, and what rank 0 reports.

    (PipelineEngine.step, run by the executor's `step` op on every rank)
    "bf16": {"enabled": true}                       or
    "fp16": {"enabled": true, "initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1}
    "steps_per_print": 10            rank 0: "steps: 10 loss: 2.3456 iter time (s): 0.512 samples/sec: 31.250"
    "tensorboard": {"enabled": true, "output_path": "runs/", "job_name": "pipe"}

Norm: each parameter once — dp replicas hold equal gradients (only replica 0 counts; under ZeRO-1
each replica counts the slice it owns, engine/zero1.py), tied copies
after the first holder are skipped (DeepSpeed's ds_pipe_replicated); with tp > 1 a sharded
parameter counts on every tp rank, a replicated one (LayerNorm, row-parallel bias) on tp rank 0
only (zero_from_scratch.engine.mpu.counts_on). The status all-reduce sums norm² over pp (and tp):
the global norm of one process, by default.
"pipeline": {"clip_norm": "stage0"} reproduces DeepSpeed's fp32 pipeline instead: its
clip_grad_norm_ (deepspeed/runtime/utils.py, `if (mpu.get_model_parallel_rank() == 0) or
is_model_parallel_parameter(p)`) sums only model-parallel rank 0's norms, and in a pipeline grid
the model-parallel group is the stages of one replica, so rank 0 is stage 0: the norm that
scales every stage's gradients is stage 0's alone (DeepSpeed's bf16/fp16 optimizers use all stages),
in its fp32 arithmetic (an fp32 norm per parameter, the coefficient in fp32: _deepspeed_fp32_coef) — its
AlexNet pipeline example matches to ~1e-6 only with both (clients/pipeline/).

Mixed precision, as DeepSpeed's pipeline engine runs it on an unfused optimizer (torch_adam, CPU):
each stage's parameters, activations and boundary messages are in the 16-bit dtype; gradients
accumulate in it over the m micro-batches, are reduced over dp in it, then copied to an fp32
master copy that the optimizer updates and that is copied back (rounded) into the stage
(2Ψ + 2Ψ + 4Ψ + K·Ψ bytes). fp16: the last stage multiplies each micro-batch's loss by the scale S
before backward (so every stage's gradients and the boundary gradients carry S); the norm is of the
scaled gradients ÷ S — one non-finite value anywhere and every stage skips the step
(skipped_steps += 1; the status all-reduce carries the norm), and the lr scheduler does not advance.
The scale follows DeepSpeed's FP16_UnfusedOptimizer._update_scale: 2^initial_scale_power at start,
halved on every overflow (not below min_loss_scale; no hysteresis on this path), doubled after
loss_scale_window clean steps. bf16: no scale; a non-finite gradient skips the step too.

Reporting (StepReport): DeepSpeed's PipelineEngine.train_batch line every steps_per_print steps, and
the tensorboard / csv_monitor tags (zero_from_scratch/engine/monitor.py, the ZeRO engine's writer:
Train/Samples/lr, loss_scale in fp16, train_loss = the step's mean loss, grad_norm,
samples_per_sec), x = global_samples. Every rank already holds the mean loss and the global norm
(the status all-reduce), so reporting sends nothing.
Cost: one pass over Ψ_stage for the norm, 24 bytes all-reduced, the optimizer's own passes; with
masters one elementwise pass over Ψ_stage each way (grad → master, master → stage); rank 0's file writes.
"""
from __future__ import annotations

import math
import time

import torch

from primitives.log import print0
from zero_from_scratch.engine.comm import Comm
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
