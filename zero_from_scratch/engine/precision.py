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
"""
from __future__ import annotations

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
