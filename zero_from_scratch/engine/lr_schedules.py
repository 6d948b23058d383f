"""DeepSpeed's LR schedules (deepspeed/runtime/lr_schedules.py) over the engine's optimizer:
WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest (VALID_LR_SCHEDULES, its names).

    python -m pytest tests/test_zero_units.py -k warmup
    python -m pytest tests/test_zero_surface.py -k schedule       (against DeepSpeed's classes)

The LR starts at warmup_min_lr (the first *two* steps use it with log warm-up, since log(1) = 0),
rises over max(2, warmup_num_steps) steps (log or linear), then is held (WarmupLR) or decays
linearly to 0 at total_num_steps (WarmupDecayLR). `warmup_gamma` is that formula as a pure
function, the one copy: the scheduler classes here, the pipeline engine and classification's
lr_at (the DDP engine's LambdaLR and the printed LR curve) all call it.
WarmupCosineLR, OneCycle and LRRangeTest keep DeepSpeed's arithmetic and its quirks, each named
where it is written (WarmupCosineLR sets lr 0 at construction, so the first step runs at lr 0;
OneCycle writes betas = (momentum, 0.99)). Each is stepped once per optimizer step.
"""
from __future__ import annotations

import math

import torch

from zero_from_scratch.optim import ShardedAdam

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
SCHEDULE_KEYS = {"warmup_min_ratio", "cos_min_ratio", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate",   # params
                 "cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",        # of the
                 "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom",   # newer
                 "cycle_max_mom", "decay_mom_rate", "lr_range_test_min_lr", "lr_range_test_step_size",  # types
                 "lr_range_test_step_rate", "lr_range_test_staircase"}


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
    """lr = min + (max - min)·γ(t), γ = log(t+1)/log(W) or t/W during warm-up, then 1.
    apply_on_load: load_state_dict sets the loaded step's lr at once (ringzero's own); False is DeepSpeed's
    (lr_schedules.py::WarmupLR.load_state_dict sets only last_batch_iteration: get_last_lr() keeps the
    construction value, and the groups keep theirs, until the next step), the runner's (quirks.lr_on_load)."""
    apply_on_load = True

    def __init__(self, optimizer: ShardedAdam, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:   # DeepSpeed's check (lr_schedules.py)
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
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
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, last_batch_iteration=None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        if self.apply_on_load:
            self._apply()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then γ = max(0, (T - t) / max(1, T - W)): linear decay to 0 at total_num_steps T."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)


def _per_group(optimizer, value, name: str) -> list:
    """DeepSpeed's _format_param: a scalar for every group, or a list with one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _set_lrs(optimizer, lrs) -> list[float]:
    """Each group's lr ← lrs; a tensor lr is filled in place, as DeepSpeed's update_lr does (a compiled or
    capturable optimizer holds that tensor). The values set, tensors cloned."""
    for g, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(g["lr"]):
            g["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            g["lr"] = lr
    return [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups]


class _Iter:
    """state_dict / load_state_dict / get_last_lr / step(t) as DeepSpeed's schedulers share them."""

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, last_batch_iteration=None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())


class WarmupCosineLR(_Iter):
    """lr = base·ratio: warm-up from warmup_min_ratio to 1 (log or linear over W = max(2, warmup_num_steps)),
    then (1 + cos(π·min(1, (t-W+1)/max(1, T-W))))/2 scaled into [cos_min_ratio, 1]. Quirk: lr 0
    until the first step() (DeepSpeed's get_lr before any step)."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log", last_batch_iteration=-1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer, self.total_num_steps, self.last_batch_iteration = optimizer, total_num_steps, last_batch_iteration
        self.cos_min_ratio, self.warmup_min_ratio = cos_min_ratio, warmup_min_ratio
        self.warmup_type = warmup_type if warmup_type in ("log", "linear") else "log"
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        t, w = self.last_batch_iteration, self.warmup_num_steps
        if t < 0:
            return 0.0
        if t < w:
            r = self.inverse_log_warm_up * math.log(t + 1) if self.warmup_type == "log" else t / w
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - w + 1) / max(1, self.total_num_steps - w))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ((1 + math.cos(math.pi * progress)) / 2))

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        r = self.get_lr_ratio()
        return [lr * r for lr in self.org_lrs]


class OneCycle(_Iter):
    """1cycle (Smith, arXiv 1803.09820): lr rises min → max over cycle_first_step_size steps, falls
    back over cycle_second_step_size, then decays as min / (1 + rate·t/decay_step_size); momentum
    (betas[0]) moves the opposite way. Quirk kept: betas become (momentum, 0.99)."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        self.optimizer = optimizer
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError(f"cycle_first_step_size must be positive and cycle_second_step_size non-negative, got "
                             f"{first}, {second}")
        self.total_size, self.first_step_size, self.second_step_size = first + second, first, second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            _set_lrs(optimizer, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = self.skip_lr_decay or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.param_groups[0]   # DeepSpeed warns and drops it
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for m, g in zip(self.min_moms, optimizer.param_groups):
                    g["betas"] = m
            self.skip_mom_decay = self.skip_mom_decay or math.isclose(decay_mom_rate, 0)
        self.last_batch_iteration = last_batch_iteration

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        x = 1.0 + it / self.total_size - math.floor(1 + it / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            ci = it % self.total_size
            pos = (ci * stairs / self.first_step_size if ci <= self.first_step_size
                   else (self.total_size - ci) * stairs / self.second_step_size)
            scale = math.floor(pos) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return self.min_lrs
        f = 1 + self.decay_lr_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / f for lo in self.min_lrs]

    def get_mom(self) -> list[tuple]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * s, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return self.max_moms
        f = 1 + self.decay_mom_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [(b0 * f, b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration=None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            for g, m in zip(self.optimizer.param_groups, self.get_mom()):
                g["betas"] = m


class LRRangeTest(_Iter):
    """lr = min_lr·(1 + step_rate·(t+1)/step_size) (floored interval with staircase)."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000, lr_range_test_step_rate=1.0,
                 lr_range_test_staircase=False, last_batch_iteration=-1):
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}")
        self.optimizer, self.min_lr = optimizer, _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate, self.staircase = lr_range_test_step_size, lr_range_test_step_rate, lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.min_lr)

    def get_lr(self) -> list[float]:
        t = float(self.last_batch_iteration + 1) / self.step_size
        inc = 1 + self.step_rate * (math.floor(t) if self.staircase else t)
        return [lr * inc for lr in self.min_lr]


def build_scheduler(cfg, optimizer: ShardedAdam):
    """cfg: config.SchedulerConfig or None (its `params`: the section's own, for the newer types)."""
    if cfg is None:
        return None
    if cfg.type in ("WarmupCosineLR", "OneCycle", "LRRangeTest"):
        try:
            return globals()[cfg.type](optimizer, **cfg.params)
        except TypeError as e:     # DeepSpeed passes the params as keywords too: the same TypeError
            raise ValueError(f"config key 'scheduler.params' for {cfg.type}: {e}") from None
    common = dict(warmup_min_lr=cfg.warmup_min_lr, warmup_num_steps=cfg.warmup_num_steps, warmup_type=cfg.warmup_type)
    if cfg.type == "WarmupLR":
        return WarmupLR(optimizer, warmup_max_lr=cfg.warmup_max_lr, **common)
    maxlr = cfg.warmup_max_lr if cfg.warmup_max_lr is not None else 0.001
    return WarmupDecayLR(optimizer, cfg.total_num_steps, warmup_max_lr=maxlr, **common)
