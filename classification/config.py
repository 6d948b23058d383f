"""DeepSpeed JSON for classification/train.py: resolve every "auto", say what it became, warn on traps.

    python classification/config.py                         # the resolved table for 2 ranks
    python classification/config.py --config my.json --world-size 4

DeepSpeed itself does not resolve "auto" (Hugging Face's Trainer does, silently); here
`resolve()` hands what the run knows (world size, steps, --lr) to zero_from_scratch.engine.auto.resolve_auto
(the one resolver, DeepSpeed's defaults otherwise, gradient_clipping 1.0 included), rejects any
"auto" nothing can fill, warns about unknown keys for every engine, and returns rows for a table,
so what trains is what is printed. The same resolved dict drives
`deepspeed.initialize` and `zero_from_scratch.initialize`; the ddp engine reads it too.
Cost: a dict walk; `lr_at` is O(1) per step.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from zero_from_scratch.engine.auto import DEFAULTS, find_auto, resolve_auto  # noqa: F401  (find_auto: re-exported)
from zero_from_scratch.engine.config import suggest, unknown_keys
from zero_from_scratch.engine.lr_schedules import warmup_gamma

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config_zero2.json")
SCHEDULERS = ("WarmupDecayLR", "WarmupLR")


class ConfigError(ValueError):
    """A config that cannot run as written; the message names the key and what was expected."""


def load_config(path: str) -> dict:
    """Read a DeepSpeed JSON; a missing path is an error, never an empty config."""
    if not os.path.isfile(path):
        raise ConfigError(f"config {path!r} does not exist (cwd {os.getcwd()}); nothing would be applied. "
                          f"The default is {DEFAULT_CONFIG}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config {path}: invalid JSON at line {e.lineno}: {e.msg}") from None


@dataclass
class RunFacts:
    """What the run knows that the JSON cannot: filled in by train.py."""
    world_size: int
    steps_per_epoch: int
    epochs: int
    lr: float = 1e-4
    warmup_frac: float = 0.1
    max_steps: int = 0
    fp16_requested: bool = False
    rows: list = field(default_factory=list)
    warnings: list = field(default_factory=list)

    def __post_init__(self):
        if self.world_size < 1 or self.steps_per_epoch < 1 or self.epochs < 1:
            raise ConfigError(f"world_size={self.world_size}, steps_per_epoch={self.steps_per_epoch}, "
                              f"epochs={self.epochs}: each must be >= 1 (too few training rows for the global batch?)")
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"warmup_frac={self.warmup_frac} must be in [0, 1)")

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps else total


def resolve(raw: dict, facts: RunFacts) -> dict:
    """A copy of `raw` with every "auto" replaced; facts.rows / facts.warnings filled. The
    resolution itself is zero_from_scratch.engine.auto.resolve_auto (one policy for both packages); this
    supplies what the run knows and the warnings about DeepSpeed's traps."""
    cfg = copy.deepcopy(raw)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if not isinstance(micro, int) or micro < 1:
        raise ConfigError(f"train_micro_batch_size_per_gpu must be a positive integer, got {micro!r}")
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    p = opt.setdefault("params", {})
    for prec in ("fp16", "bf16"):
        cfg.setdefault(prec, {})
    total = facts.total_steps
    known = {"optimizer.params.lr": (facts.lr, "--lr"),
             "gradient_clipping": (DEFAULTS["gradient_clipping"][0], "DeepSpeed's default (clips at 1.0 when absent)"),
             "fp16.enabled": (bool(facts.fp16_requested), "--fp16" if facts.fp16_requested else "not requested: fp32"),
             "bf16.enabled": (False, "not requested: fp32")}
    sch = cfg.get("scheduler")
    if sch:
        kind = sch.get("type")
        if kind not in SCHEDULERS:
            raise ConfigError(f"scheduler.type {kind!r}: train.py supports {SCHEDULERS}")
        sch.setdefault("params", {})
        known["scheduler.params.warmup_max_lr"] = (_lr_of(p, facts), "= optimizer lr")
        known["scheduler.params.warmup_num_steps"] = (max(1, math.ceil(facts.warmup_frac * total)),
                                                      f"{facts.warmup_frac:.0%} of {total} steps")
        if kind == "WarmupDecayLR":
            known["scheduler.params.total_num_steps"] = (total, f"{facts.steps_per_epoch} steps/epoch x {facts.epochs} "
                                                         "epochs" + (f", capped by --max-steps {facts.max_steps}"
                                                                     if facts.max_steps else ""))
    try:
        cfg, rows = resolve_auto(cfg, facts.world_size, known)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    facts.rows += [(path, was, str(value), why) for path, was, value, why in rows]
    for path, was, value, _ in rows:
        if path.endswith(".enabled") and was == "auto" and value is False:
            facts.warnings.append(f'{path} "auto" resolved to OFF: DeepSpeed never turns it on by '
                                  "itself (Hugging Face's Trainer does, from its own flags); training in fp32")
    unknown = unknown_keys(raw)
    if unknown:
        facts.warnings.append("unknown config keys, ignored by every engine (DeepSpeed without a word): "
                              + ", ".join(k + suggest(k) for k in unknown))
    if not p.get("torch_adam", False) and opt.get("type", "").lower() in ("adam", "adamw"):
        facts.warnings.append("optimizer.params.torch_adam is not true: DeepSpeed JIT-builds fused_adam "
                              "(~2 min on first use); ours sets it true")
    if opt.get("type", "").lower() == "adam" and p.get("adam_w_mode", True):
        facts.warnings.append('optimizer "Adam" runs as AdamW in DeepSpeed (adam_w_mode defaults to true)')
    if "offload_optimizer" in cfg.get("zero_optimization", {}):
        facts.warnings.append("zero_optimization.offload_optimizer switches the optimizer to DeepSpeedCPUAdam "
                              "(a JIT build; torch_adam is then ignored)")
    if sch:
        if sch["type"] == "WarmupLR":
            facts.warnings.append("scheduler WarmupLR never decays: after warm-up it holds the max LR to the "
                                  "last step; use WarmupDecayLR for a linear decay")
        if "warmup_type" not in sch["params"]:
            facts.warnings.append('scheduler.params.warmup_type is absent: DeepSpeed defaults to "log", not linear')
    return cfg


def _lr_of(params: dict, facts: RunFacts):
    lr = params.get("lr", "(absent)")
    return facts.lr if lr in ("auto", "(absent)") else lr


def lr_at(cfg: dict, step: int) -> float:
    """The LR the optimizer uses at optimizer step `step` (0-based), exactly as DeepSpeed's
    WarmupLR / WarmupDecayLR produce it: the scheduler is built with last_batch_iteration = -1
    (LR = warmup_min_lr) and stepped after each optimizer step, so steps 0 and 1 both use
    warmup_min_lr. The formula is zero_from_scratch.engine.lr_schedules.warmup_gamma (one copy)."""
    sch = cfg.get("scheduler")
    base = cfg["optimizer"]["params"]["lr"]
    if not sch:
        return base
    p = sch["params"]
    lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", base)
    it = step - 1  # the scheduler's last_batch_iteration while this step runs
    if it < 0:
        return lo
    total = p["total_num_steps"] if sch["type"] == "WarmupDecayLR" else None
    return lo + (hi - lo) * warmup_gamma(it, p.get("warmup_num_steps", 1000), p.get("warmup_type", "log"), total)


def table(facts: RunFacts, cfg: dict, extra: list = ()):
    """A rich table: every resolved value and what the run will actually do."""
    t = Table(title="resolved configuration (what actually trains)")
    for c in ("key", "in the JSON", "resolved to", "why / where from"):
        t.add_column(c)
    for r in facts.rows:
        t.add_row(*r)
    total = facts.total_steps
    t.add_row("LR at first / mid / last step", "", " / ".join(f"{lr_at(cfg, s):.3g}" for s in (0, total // 2, total - 1)),
              f"{cfg.get('scheduler', {}).get('type', 'constant')} over {total} steps")
    if not any(r[0] == "gradient_clipping" for r in facts.rows):   # given in the JSON: say what it does
        t.add_row("gradient_clipping", str(cfg["gradient_clipping"]), str(cfg["gradient_clipping"]),
                  "global norm over all ranks' gradients (0 = off)")
    t.add_row("zero_optimization.stage", str(cfg.get("zero_optimization", {}).get("stage", "(absent)")),
              str(cfg.get("zero_optimization", {}).get("stage", 0)), "")
    for r in extra:
        t.add_row(*r)
    return t


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps-per-epoch", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    try:
        f = RunFacts(a.world_size, a.steps_per_epoch, a.epochs)
        c = resolve(load_config(a.config), f)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    con = Console()
    con.print(table(f, c))
    for w in f.warnings:
        con.print(f"[yellow]warning:[/yellow] {w}")
