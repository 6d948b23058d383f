"""DeepSpeed's WarmupLR / WarmupDecayLR (deepspeed/runtime/lr_schedules.py) over ShardedAdam.

    python -m pytest tests/test_zero_units.py -k warmup

The LR starts at warmup_min_lr (the first *two* steps use it with log warm-up, since log(1) = 0),
rises over max(2, warmup_num_steps) steps (log or linear), then is held (WarmupLR) or decays
linearly to 0 at total_num_steps (WarmupDecayLR). `warmup_gamma` is that formula as a pure
function, the one copy: the scheduler classes here, the pipeline engine and classification's
lr_at (the DDP engine's LambdaLR and the printed LR curve) all call it.
"""
from __future__ import annotations

import math

from zero_from_scratch.optim import ShardedAdam


def warmup_gamma(t: int, warmup_num_steps: int, warmup_type: str = "log", total_num_steps: int | None = None) -> float:
    """DeepSpeed's γ at last_batch_iteration t (lr = min + (max - min)·γ): log(t+1)/log(W) or t/W
    during warm-up (W = max(2, warmup_num_steps)), then 1 (WarmupLR, total_num_steps None) or
    (T - t) / max(1, T - W), floored at 0 (WarmupDecayLR). Written in DeepSpeed's operation order
    (1/log(W) first), so the LRs are bit-identical to its scheduler's."""
    w = max(2, warmup_num_steps)
    if t < w:
        if warmup_type == "log":
            return (1.0 / math.log(w)) * math.log(t + 1)
        return t / w
    if total_num_steps is None:
        return 1.0
    return max(0.0, float(total_num_steps - t) / float(max(1.0, total_num_steps - w)))


class WarmupLR:
    """lr = min + (max - min)·γ(t), γ = log(t+1)/log(W) or t/W during warm-up, then 1."""

    def __init__(self, optimizer: ShardedAdam, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        self.optimizer = optimizer
        n = len(optimizer.param_groups)
        maxes = warmup_max_lr if warmup_max_lr is not None else [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = list(warmup_min_lr) if isinstance(warmup_min_lr, (list, tuple)) else [warmup_min_lr] * n
        self.max_lrs = list(maxes) if isinstance(maxes, (list, tuple)) else [maxes] * n
        self.delta_lrs = [b - a for a, b in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.total_num_steps = getattr(self, "total_num_steps", None)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type, self.total_num_steps)
        return [a + d * gamma for a, d in zip(self.min_lrs, self.delta_lrs)]

    def _apply(self) -> None:
        for g, lr in zip(self.optimizer.param_groups, self.get_lr()):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, last_batch_iteration=None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._apply()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then γ = max(0, (T - t) / max(1, T - W)): linear decay to 0 at total_num_steps T."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)


def build_scheduler(cfg, optimizer: ShardedAdam):
    """cfg: config.SchedulerConfig or None."""
    if cfg is None:
        return None
    common = dict(warmup_min_lr=cfg.warmup_min_lr, warmup_num_steps=cfg.warmup_num_steps, warmup_type=cfg.warmup_type)
    if cfg.type == "WarmupLR":
        return WarmupLR(optimizer, warmup_max_lr=cfg.warmup_max_lr, **common)
    maxlr = cfg.warmup_max_lr if cfg.warmup_max_lr is not None else 0.001
    return WarmupDecayLR(optimizer, cfg.total_num_steps, warmup_max_lr=maxlr, **common)
