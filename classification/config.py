"""DeepSpeed JSON for classification/train.py: resolve every "auto", say what it became, warn on traps.

    python classification/config.py                         # the resolved table for 2 ranks
    python classification/config.py --config my.json --world-size 4

DeepSpeed itself does not resolve "auto" (Hugging Face's Trainer does, silently); here
`resolve()` fills each one from the run (world size, steps, --lr), rejects any it does not know,
and returns rows for a table, so what trains is what is printed. The same resolved dict drives
`deepspeed.initialize` and `zero_from_scratch.initialize`; the ddp engine reads it too.
Cost: a dict walk; `lr_at` is O(1) per step.
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config_zero2.json")
SCHEDULERS = ("WarmupDecayLR", "WarmupLR")


class ConfigError(ValueError):
    """A config that cannot run as written; the message names the key and what was expected."""


def load_config(path: str) -> dict:
    """Read a DeepSpeed JSON; a missing path is an error (the seed silently ignored it)."""
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


def _set(cfg, keys, facts: RunFacts, value, why):
    d = cfg
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    was = d.get(keys[-1], "(absent)")
    if was == "auto" or was == "(absent)":
        d[keys[-1]] = value
        facts.rows.append((".".join(keys), str(was), str(value), why))
    return d[keys[-1]]


def resolve(raw: dict, facts: RunFacts) -> dict:
    """A copy of `raw` with every "auto" replaced; facts.rows / facts.warnings filled."""
    cfg = copy.deepcopy(raw)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if not isinstance(micro, int) or micro < 1:
        raise ConfigError(f"train_micro_batch_size_per_gpu must be a positive integer, got {micro!r}")
    gas = _set(cfg, ["gradient_accumulation_steps"], facts, 1, "DeepSpeed's default")
    glob = micro * gas * facts.world_size
    tbs = _set(cfg, ["train_batch_size"], facts, glob, f"micro {micro} x accumulation {gas} x world {facts.world_size}")
    if tbs != glob:
        raise ConfigError(f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} x "
                          f"gradient_accumulation_steps {gas} x world size {facts.world_size} = {glob}")
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    p = opt.setdefault("params", {})
    lr = _set(cfg, ["optimizer", "params", "lr"], facts, facts.lr, "--lr")
    if not p.get("torch_adam", False) and opt.get("type", "").lower() in ("adam", "adamw"):
        facts.warnings.append("optimizer.params.torch_adam is not true: DeepSpeed JIT-builds fused_adam "
                              "(~2 min on first use); ours sets it true")
    if opt.get("type", "").lower() == "adam" and p.get("adam_w_mode", True):
        facts.warnings.append('optimizer "Adam" runs as AdamW in DeepSpeed (adam_w_mode defaults to true)')
    if "offload_optimizer" in cfg.get("zero_optimization", {}):
        facts.warnings.append("zero_optimization.offload_optimizer switches the optimizer to DeepSpeedCPUAdam "
                              "(a JIT build; torch_adam is then ignored)")
    for prec in ("fp16", "bf16"):
        sec = cfg.setdefault(prec, {})
        was = sec.get("enabled", "(absent)")
        on = bool(facts.fp16_requested) if prec == "fp16" else False
        if was in ("auto", "(absent)"):
            sec["enabled"] = on
            facts.rows.append((f"{prec}.enabled", str(was), str(on), "--fp16" if on else "not requested: fp32"))
            if was == "auto" and not on:
                facts.warnings.append(f'{prec}.enabled "auto" resolved to OFF: DeepSpeed never turns it on by '
                                      "itself (Hugging Face's Trainer does, from its own flags); training in fp32")
    sch = cfg.get("scheduler")
    if sch:
        kind = sch.get("type")
        if kind not in SCHEDULERS:
            raise ConfigError(f"scheduler.type {kind!r}: train.py supports {SCHEDULERS}")
        sp = sch.setdefault("params", {})
        total = facts.total_steps
        _set(cfg, ["scheduler", "params", "warmup_max_lr"], facts, lr, "= optimizer lr")
        _set(cfg, ["scheduler", "params", "warmup_num_steps"], facts, max(1, math.ceil(facts.warmup_frac * total)),
             f"{facts.warmup_frac:.0%} of {total} steps")
        if kind == "WarmupDecayLR":
            _set(cfg, ["scheduler", "params", "total_num_steps"], facts, total,
                 f"{facts.steps_per_epoch} steps/epoch x {facts.epochs} epochs" + (
                     f", capped by --max-steps {facts.max_steps}" if facts.max_steps else ""))
        else:
            facts.warnings.append("scheduler WarmupLR never decays: after warm-up it holds the max LR to the "
                                  "last step; use WarmupDecayLR for a linear decay")
        if "warmup_type" not in sp:
            facts.warnings.append('scheduler.params.warmup_type is absent: DeepSpeed defaults to "log", not linear')
    leftover = _find_auto(cfg)
    if leftover:
        raise ConfigError(f'"auto" values train.py cannot resolve: {leftover}; give them numbers')
    return cfg


def _find_auto(d, path=""):
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _find_auto(v, f"{path}.{k}" if path else k)
    elif d == "auto":
        out.append(path)
    return out


def lr_at(cfg: dict, step: int) -> float:
    """The LR the optimizer uses at optimizer step `step` (0-based), exactly as DeepSpeed's
    WarmupLR / WarmupDecayLR produce it: the scheduler is built with last_batch_iteration = -1
    (LR = warmup_min_lr) and stepped after each optimizer step, so steps 0 and 1 both use
    warmup_min_lr; warm-up length is max(2, warmup_num_steps)."""
    sch = cfg.get("scheduler")
    base = cfg["optimizer"]["params"]["lr"]
    if not sch:
        return base
    p = sch["params"]
    lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", base)
    warm = max(2, p.get("warmup_num_steps", 1000))
    it = step - 1  # the scheduler's last_batch_iteration while this step runs
    if it < 0:
        return lo
    if it < warm:
        gamma = it / warm if p.get("warmup_type", "log") == "linear" else math.log(it + 1) / math.log(warm)
    elif sch["type"] == "WarmupDecayLR":
        total = p["total_num_steps"]
        gamma = max(0.0, (total - it) / max(1.0, total - warm))
    else:
        gamma = 1.0
    return lo + (hi - lo) * gamma


def table(facts: RunFacts, cfg: dict, extra: list = ()):
    """A rich table: every resolved value and what the run will actually do."""
    from rich.table import Table
    t = Table(title="resolved configuration (what actually trains)")
    for c in ("key", "in the JSON", "resolved to", "why / where from"):
        t.add_column(c)
    for r in facts.rows:
        t.add_row(*r)
    total = facts.total_steps
    t.add_row("LR at first / mid / last step", "", " / ".join(f"{lr_at(cfg, s):.3g}" for s in (0, total // 2, total - 1)),
              f"{cfg.get('scheduler', {}).get('type', 'constant')} over {total} steps")
    t.add_row("gradient_clipping", str(cfg.get("gradient_clipping", "(absent)")),
              str(cfg.get("gradient_clipping", 0.0)), "global norm over all ranks' gradients (0 = off)")
    t.add_row("zero_optimization.stage", str(cfg.get("zero_optimization", {}).get("stage", "(absent)")),
              str(cfg.get("zero_optimization", {}).get("stage", 0)), "")
    for r in extra:
        t.add_row(*r)
    return t


if __name__ == "__main__":
    import argparse

    from rich.console import Console
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
