"""The optimizer step of a pipeline rank: gradient norm, status all-reduce, clipping, update.

    (PipelineEngine.step, run by the executor's `step` op on every rank)

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
Mixed precision (engine/mixed.py): the norm is of the scaled gradients ÷ S; a non-finite norm
skips the step on every rank (skipped_steps += 1, no scheduler step), as DeepSpeed's engine.
Cost: one pass over Ψ_stage for the norm, 24 bytes all-reduced, the optimizer's own passes.
"""
from __future__ import annotations

import math

import torch

from zero_from_scratch.engine.mpu import counts_on


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
    scale = e.scaler.cur_scale if e.scaler is not None else 1.0
    e.global_grad_norm /= scale
    clip = e.cfg.run.gradient_clipping
    if e.zero1 is not None:
        applied = e.mixed is None or math.isfinite(e.global_grad_norm)
        coef = clip / (e.global_grad_norm + 1e-6) if clip > 0 and applied else 1.0
        if applied:
            e.zero1.step(min(coef, 1.0) / scale)
        else:
            e.zero1.skip()
    elif e.mixed is not None:
        applied = e.mixed.step(e.optimizer, clip, e.global_grad_norm, scale)
    else:
        if clip > 0 and e.clip_norm == "stage0":
            coef = _deepspeed_fp32_coef(e, clip)
            for p in e.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        elif clip > 0:
            coef = clip / (e.global_grad_norm + 1e-6)
            if coef < 1:
                for p in e.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        e.optimizer.step()
        e.optimizer.zero_grad(set_to_none=True)
        applied = True
    if e.scaler is not None:
        e.scaler.update(overflow=not applied)
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
