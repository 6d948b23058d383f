"""One optimizer step of the ZeRO engine: the global gradient norm, overflow, clipping, Adam on the
owned shards (in chunks), the stage's after_step, the LR schedule and the loss scale.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 2

Gradients hold the SUM over ranks of loss-scaled gradients (× grad_keys' `pre`), so the global norm (clip.py: local
Σ g² in float64, one 8-byte all-reduce; the monitor's loss rides along, +8 bytes; with an mpu one
more 8-byte all-reduce over the model-parallel group, replicated parameters counted once) is
divided by N · loss_scale, and each gradient chunk is scaled by clip_coef / (N · loss_scale) (with
gradient_allreduce_op / prescale_gradients / gradient_predivide_factor: grad_keys.Reduction.post_divisor).
A non-finite norm skips the step (the loss scaler halves its scale), except at ZeRO stages 1-2 in bf16 with
bf16.check_grad_overflow false: DeepSpeed's ZeRO optimizer steps anyway (stage_1_and_2.py `step`).
"""
from __future__ import annotations

import math

import torch

from zero_from_scratch.clip import clip_coef, sum_of_squares
from zero_from_scratch.engine import moe_grads
from zero_from_scratch.engine.comm import reset_all
from zero_from_scratch.engine.offload import done_with
from zero_from_scratch.engine.precision import average_like_deepspeed, deepspeed_unscale
from zero_from_scratch.engine.safe_api import apply_pending
from zero_from_scratch.engine.z3_ds_tensor import restore_masters

STEP_CHUNK = 1 << 22   # elements per optimizer-step chunk (16 MiB of fp32 temporaries)


def checks_overflow(engine) -> bool:
    """Does a non-finite gradient norm skip the step? DeepSpeed: always, but at stages 1-2 in bf16 only
    when bf16.check_grad_overflow (default true; engine.py _configure_zero_optimizer)."""
    bf16 = engine.config.raw.get("bf16", engine.config.raw.get("bfloat16")) or {}
    return not (engine.config.bf16 and engine.stage_id in (1, 2) and bf16.get("check_grad_overflow", True) is False)


def optimizer_step(engine) -> None:
    N, units = engine.comm.size, engine.layout.units
    divisor = average_like_deepspeed(engine)          # the runner at stage 0 in 16 bits: ÷N already (precision.py)
    loss = engine.monitor.local_loss()                 # None unless a monitor is enabled
    sq = torch.zeros(1 if loss is None else 2, dtype=torch.float64, device=engine.device)
    for i, u in enumerate(units):
        g = engine.stage.grad_shard(u)
        if engine.norm_ranges is None:
            sq[0] += sum_of_squares(g)
        else:                                        # model parallel: replicated params once
            for a, b in engine.norm_ranges[i]:
                sq[0] += sum_of_squares(g[a:b])
        done_with(engine.stage, u, params=False)    # an offloaded gradient shard leaves memory (offload.py)
    if loss is not None:
        sq[1] = loss
    if engine.stage_id > 0 and N > 1:                  # the monitor's loss rides along: +8 bytes
        engine.comm.all_reduce(sq, purpose="grad-norm all-reduce")
    elif loss is not None and N > 1:                 # stage 0: no norm all-reduce to ride on
        engine.comm.all_reduce(sq[1:], purpose="monitor loss all-reduce")
    if engine.mp is not None:                          # tp ranks hold the same loss: only the norm
        engine.mp.all_reduce(sq[:1], purpose="grad-norm all-reduce (model parallel)")
    # grads hold the SUM over ranks of loss_scale · pre · g: ÷ N·pre averaging, ÷ pre summing (grad_keys.py)
    scale = divisor * engine.loss_scaler.loss_scale
    norm = moe_grads.stage0_norm(engine, math.sqrt(sq[0].item()) / scale, scale)   # ZeRO-0 with MoE: DeepSpeed's
    overflow = not math.isfinite(norm) and checks_overflow(engine)
    ds = getattr(engine, "ds_wrapper", False) and divisor == 1.0     # the runner, ZeRO-0 in 16 bits
    engine.optimizer.overflow = overflow             # DeepSpeed's ZeRO optimizer attribute (accelerate reads it)
    engine.applied_at = None if overflow else engine.micro_steps     # surface.was_step_applied
    if overflow:
        engine._global_grad_norm = float("inf")
        engine.skipped_steps += 1
    else:
        if not math.isfinite(norm):        # unchecked (bf16.check_grad_overflow false): DeepSpeed reads inf,
            norm = float("inf")            # so clipping zeroes the finite gradients
        engine._global_grad_norm = norm
        clip = engine.config.gradient_clipping
        coef = clip_coef(norm, clip)                 # eps once, on the global norm (clip.py)
        restore_masters(engine)                      # ZeRO-3 fp32: a ds_tensor write leaves the master (z3_ds_tensor.py)
        apply_pending(engine)                        # fp32 weights set by safe_set_full_fp32_param (safe_api.py)
        shared = shared_step_turns(engine.optimizer)
        if engine.offload is not None:        # the same Adam, through files or on the host (offload*.py)
            engine.offload.step(coef, scale)
        else:
            # DeepSpeed's wrapper updates the loss scale before it unscales (precision.deepspeed_unscale)
            update_shards(engine, deepspeed_unscale(engine, norm, clip) if ds else coef / scale, in_place=True)
        shared_step_end(engine.optimizer, shared)
        engine.stage.after_step()
        sync_steps(engine)
        for opt in (engine.optimizer, engine.client_optimizer):
            if opt is not None:
                opt._opt_called = True                   # torch's LR schedulers check it: stepped, not skipped
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step(**(getattr(engine, "lr_kwargs", None) or {}))
    if overflow or not ds:                           # a wrapper step that applied has updated it already
        engine.loss_scaler.update_scale(overflow)
    engine.stage.zero_grad()
    engine.global_steps += 1
    engine.global_samples += engine.samples_this_step()   # DeepSpeed's count (z_ua_boundary.py)
    engine.monitor.write_step(engine, None if loss is None else sq[1].item() / N)   # mean over ranks
    reset_all(engine)                                # the engine's Comm and the MoE expert groups'


def shared_step_turns(opt):
    """Under the runner, after a ZeRO-3 universal load (checkpoint_universal.py, quirks.py): DeepSpeed's groups
    share one Adam step tensor that each group's step advances in turn, so group i of G counts base + i + 1.
    Sets each group's step to the shared count as its turn sees it (its step_group adds the 1); returns the base."""
    order = getattr(opt, "shared_step", None)
    if not order:
        return None
    base = opt.state[order[0]]["step"]
    for i, g in enumerate(order):
        opt.state[g]["step"] = base + i
    return base


def shared_step_end(opt, base) -> None:
    """Every group then reads the shared count, base + G, as DeepSpeed's state["step"] does."""
    if base is not None:
        for g in opt.shared_step:
            opt.state[g]["step"] = base + len(opt.shared_step)


def update_shards(engine, mult: float, in_place: bool) -> None:
    """The optimizer's update of every owned shard with gradient × mult (in place: the gradient
    buffer is zeroed next anyway)."""
    first = set()
    for u in engine.layout.units:
        g = engine.stage.grad_shard(u)
        master = (engine.master[u.group][u.local_offset:u.local_offset + u.shard] if engine.mixed
                  else engine.stage.param_shard(u))
        # Adam is elementwise: stepping in chunks gives the same bits, and keeps its
        # temporaries (the fp32 gradient copy, sqrt(v), the denominator) at STEP_CHUNK
        # elements instead of a whole shard each (134 MB apiece for DistilBERT at N=2).
        for a in range(0, max(u.shard, 1), STEP_CHUNK):
            b = min(a + STEP_CHUNK, u.shard)
            g32 = g[a:b].float() if engine.mixed else g[a:b]
            g32 = g32.mul_(mult) if in_place or engine.mixed else g32.mul(mult)
            engine.optimizer.step_group(u.group, master[a:b], g32, u.local_offset + a, u.local_offset + b,
                                        count=u.group not in first)
            first.add(u.group)
            if engine.mixed:
                engine.stage.param_shard(u)[a:b].copy_(master[a:b])
        done_with(engine.stage, u)               # an offloaded parameter shard goes back now (offload.py)


def client_step(engine) -> None:
    """The stage-0 fp32 client object's own step() (client_optim.serve_basic): DeepSpeed's
    optimizer.step() on the averaged gradients as they stand: no clipping, no skip, no scheduler;
    the gradients stay (engine.step() or zero_grad() clears them)."""
    update_shards(engine, 1.0 / (engine.config.reduction.post_divisor * engine.loss_scaler.loss_scale), in_place=False)
    engine.stage.after_step()
    sync_steps(engine)


def sync_steps(engine) -> None:
    """The stage-0 client object's per-parameter "step" follows the sharded optimizer's count."""
    for t, st in zip(getattr(engine, "basic_steps", ()), engine.optimizer.state):
        t.fill_(st["step"])
