"""Precision: which dtype the model runs in, and fp16's dynamic loss scaler.

    python -m pytest tests/test_zero_units.py

fp32   params, grads and Adam in fp32; the flat parameter buffer *is* the master copy.
bf16   params and grads in bf16 (2 bytes), an fp32 master shard per rank, Adam in fp32.
fp16   as bf16, plus loss scaling: the loss is multiplied by S before backward so small
       gradients survive fp16's narrow range; the optimizer divides by S again. If any gradient
       is inf/NaN the step is skipped and S shrinks.

DynamicLossScaler follows DeepSpeed's (deepspeed/runtime/fp16/loss_scaler.py) step for step:
on overflow, if hysteresis is exhausted the scale halves (not below min_scale), otherwise the
hysteresis counter drops by one; after `scale_window` clean iterations since the last
overflow the scale doubles (and hysteresis refills). `cur_iter` counts every optimizer step,
skipped or not.

wrapper_first_step (the runner's, inside deepspeed_wrappers()): at ZeRO stage 0 in bf16/fp16 DeepSpeed
wraps the optimizer in FP16_Optimizer (a FusedAdam) or FP16_UnfusedOptimizer (any other), whose
constructor steps it once on zero gradients (initialize_optimizer_states): the step count starts at 1,
weight decay acts once on the fp32 masters (and Adam's L2 / SGD's decay, fed back as a gradient, moves
them and fills the states), the 16-bit weights keep their values until the first real step copies the
masters over them. One pass over the masters at initialize, no communication.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from zero_from_scratch.engine.mixed_cast import NAMES     # DeepSpeed's DtypeEnum spellings


def model_dtype(cfg) -> torch.dtype:
    if cfg.bf16:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return torch.float32


def grad_dtype(cfg, stage: int) -> torch.dtype:
    """The dtype gradients accumulate in: the model's, or fp32 for bf16 with data_types.grad_accum_dtype
    fp32 at stages 1-2 (DeepSpeed's BF16_Optimizer at stage 1, its ZeRO optimizer at stage 2 and under
    offload keep fp32 gradient buffers; zero_keys.value_notes refuses the other combinations). 2 bytes/element more on
    stage 1's full gradient buffer, on stage 2's Ψ/N shard."""
    return torch.float32 if fp32_accum(cfg.raw, cfg.bf16, stage) else model_dtype(cfg)


def fp32_accum(raw: dict | None, bf16: bool, stage: int) -> bool:
    """bf16 with data_types.grad_accum_dtype fp32 at stages 1-2: the one case served in another dtype."""
    want = ((raw or {}).get("data_types") or {}).get("grad_accum_dtype")
    return bf16 and stage in (1, 2) and want in NAMES[torch.float32]


def deepspeed_bf16_optimizer(cfg, stage: int) -> bool:
    """Whether DeepSpeed would wrap the optimizer in its BF16_Optimizer: bf16 with fp32 gradient accumulation
    at stage 1 unless the optimizer is offloaded to the CPU (engine.py _configure_optimizer, zero_cpu_offload():
    nvme offload builds it too). Its coalesce_grad_reduction refuses there; the runner's classes follow it."""
    device = (cfg.offload_optimizer or {}).get("device")
    return stage == 1 and grad_dtype(cfg, stage) == torch.float32 and model_dtype(cfg) == torch.bfloat16 \
        and device != "cpu"


_AS_DEEPSPEED = contextvars.ContextVar("ringzero_deepspeed_wrappers", default=False)


@contextlib.contextmanager
def deepspeed_wrappers():
    """Engines built inside follow DeepSpeed's 16-bit optimizer wrappers (the runner's initialize)."""
    token = _AS_DEEPSPEED.set(True)
    try:
        yield
    finally:
        _AS_DEEPSPEED.reset(token)


def wrapper_first_step(engine) -> None:
    """DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer construction step (module docstring), on the
    engine's fp32 masters, before any LR scheduler exists (DeepSpeed builds it after the optimizer):
    engine.py _do_optimizer_sanity_check (stage 0, 16-bit, gradients in the model dtype → FP16 /
    DDP_BFLOAT16) → _configure_fp16_optimizer; fp16/unfused_optimizer.py and fp16/fused_optimizer.py
    initialize_optimizer_states: every gradient zero, `self.optimizer.step()`, no copy to the 16-bit weights."""
    if not _AS_DEEPSPEED.get() or engine.stage_id != 0 or not engine.mixed or engine.offload is not None:
        return
    if not engine.config.raw.get("optimizer") and engine.client_optimizer is None:
        return      # no optimizer in the config nor from the client: DeepSpeed wraps none and steps nothing
    engine.ds_wrapper = True           # average_like_deepspeed reads it at every step
    first = set()
    for u in engine.layout.units:
        master = engine.master[u.group][u.local_offset:u.local_offset + u.shard]
        engine.optimizer.step_group(u.group, master, torch.zeros_like(master), u.local_offset,
                                    u.local_offset + u.shard, count=u.group not in first)
        first.add(u.group)


def average_like_deepspeed(engine) -> float:
    """The divisor the step still applies to the summed gradients (ringzero's own: reduction.post_divisor, in fp32
    at the step). Under the runner at stage 0 in bf16/fp16 with the default averaging (no prescale_gradients,
    gradient_predivide_factor 1) DeepSpeed multiplies each all-reduced bucket by 1/N in the model dtype (engine.py
    allreduce_bucket: `tensor_to_allreduce.mul_(self.gradient_predivide_factor() / dp_world_size)`), rounded there:
    done here on the gradient buffer, 1 left. Exact for N a power of two; one rounding of the 16-bit type otherwise.
    A communication_data_type other than the model's (fp32 under bf16, where DeepSpeed multiplies the fp32 sum and
    rounds once) never gets here: the engine refuses it (grad_keys.py), so the bucket is in the model dtype."""
    r = engine.config.reduction
    if not getattr(engine, "ds_wrapper", False) or r.pre != 1.0 or r.post_divisor == 1.0:
        return r.post_divisor
    for u in engine.layout.units:
        engine.stage.grad_shard(u).mul_(1.0 / r.post_divisor)
    return 1.0


def deepspeed_multiplier(norm: float, clip: float, loss_scale: float) -> float:
    """The factor on each fp32 gradient in unscale_and_clip_grads (fp16/unfused_optimizer.py, fused_optimizer.py),
    in its operation order: 1 / (loss_scale · max(1, (norm + 1e-6) / clip)); `norm` already ÷ loss_scale."""
    combined = loss_scale
    if clip > 0.0:
        c = (norm + 1e-6) / clip
        if c > 1:
            combined = c * loss_scale
    return 1.0 / combined


def deepspeed_unscale(engine, norm: float, clip: float) -> float:
    """FP16_UnfusedOptimizer.step / FP16_Optimizer.step's order on a step that applies: `_update_scale(False)`
    before unscale_and_clip_grads, so on a step where the dynamic scale grows the gradients (which carry the
    old scale S) are divided by the new one, 2S. Updates the scaler here (the caller then leaves it alone) and
    returns the factor; `norm` is ÷ S, rescaled to ÷ the new scale (exact: both are powers of two)."""
    old = engine.loss_scaler.loss_scale
    engine.loss_scaler.update_scale(False)
    new = engine.loss_scaler.loss_scale
    return deepspeed_multiplier(norm * old / new, clip, new)


class StaticLossScaler:
    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = sd["cur_scale"]


class DynamicLossScaler(StaticLossScaler):
    dynamic = True

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int = 2,
                 consecutive_hysteresis: bool = False, scale_factor: float = 2.0, raise_error_at_min_scale: bool = True):
        super().__init__(init_scale)
        self.raise_error_at_min_scale = raise_error_at_min_scale   # DeepSpeed's flag (its unfused fp16 path: off)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise FloatingPointError(f"fp16 loss scale is already at fp16.min_loss_scale={self.min_scale} "
                                             "and gradients still overflow: the run has diverged")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = (self.cur_iter - self.last_overflow_iter) - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)


def build_loss_scaler(cfg) -> StaticLossScaler:
    f = cfg.fp16
    if not f.enabled:
        return StaticLossScaler(1.0)
    if f.loss_scale > 0:
        return StaticLossScaler(f.loss_scale)
    return DynamicLossScaler(2.0 ** f.initial_scale_power, f.loss_scale_window, f.min_loss_scale,
                             f.hysteresis, f.consecutive_hysteresis)
