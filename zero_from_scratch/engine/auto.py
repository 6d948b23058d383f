"""DeepSpeed's "auto" placeholders and batch-size arithmetic, resolved in one place, out loud.

    python -c "from zero_from_scratch.engine.auto import resolve_auto; print(resolve_auto({'train_micro_batch_size_per_gpu': 4, 'gradient_clipping': 'auto'}, 2))"

DeepSpeed does not resolve "auto" (Hugging Face's Trainer does, silently, from its own flags).
resolve_auto() returns a copy of the config with every "auto" replaced and one row per value it
filled, (path, what the JSON had, value, why), so callers can print what actually trains. Where
the value comes from, first match wins:
  1. `known`: what the run knows ({path: (value, why)}, e.g. classification's --lr or its step
     count); these also fill ABSENT keys whose section exists, as a trainer does;
  2. the batch triple: train_batch_size = micro × gradient_accumulation_steps × world_size, any
     two determine the third (DeepSpeed's rule), "auto" or absent alike;
  3. scheduler.params.warmup_max_lr = the optimizer's lr;
  4. DEFAULTS: DeepSpeed's own defaults (fp16/bf16 "auto" is OFF: DeepSpeed never turns it on).
Anything else left "auto" is a ValueError naming every path. zero_from_scratch.engine.config and
classification.config both call this: one policy. Cost: a walk over the dict.
"""
from __future__ import annotations

import copy

BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DS = "DeepSpeed's default"
DEFAULTS = {
    "optimizer.params.lr": (1e-3, "torch/DeepSpeed Adam default"), "optimizer.params.betas": ([0.9, 0.999], _DS),
    "optimizer.params.eps": (1e-8, _DS),       # weight_decay: weight_decay_default() (depends on the class)
    "gradient_clipping": (1.0, _DS),
    "fp16.enabled": (False, "DeepSpeed never turns it on by itself: fp32"),
    "bf16.enabled": (False, "DeepSpeed never turns it on by itself: fp32"),
    "bfloat16.enabled": (False, "DeepSpeed never turns it on by itself: fp32"),
    "scheduler.params.warmup_min_lr": (0.0, _DS), "scheduler.params.warmup_num_steps": (1000, _DS),
    "zero_optimization.reduce_bucket_size": (500_000_000, _DS),
    "zero_optimization.allgather_bucket_size": (500_000_000, _DS),
    "zero_optimization.stage3_prefetch_bucket_size": (50_000_000, _DS),
    "zero_optimization.stage3_param_persistence_threshold": (100_000, _DS),
}


def weight_decay_default(optimizer: dict) -> float:
    """The weight decay DeepSpeed 0.19.8 applies when optimizer.params has none: it passes the
    params straight to the optimizer class it picks, so the class's default wins — torch.optim.AdamW
    (chosen by "torch_adam": true in AdamW mode) decays 0.01; torch Adam, FusedAdam and
    DeepSpeedCPUAdam decay 0. AdamW mode: type "AdamW", or "Adam" with adam_w_mode (default true)."""
    p = optimizer.get("params", {}) or {}
    adamw = str(optimizer.get("type", "AdamW")).lower() == "adamw" or p.get("adam_w_mode", True)
    return 0.01 if p.get("torch_adam", False) and adamw else 0.0


def _get(d: dict, path: str):
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            return "(absent)"
        d = d[k]
    return d


def _put(d: dict, path: str, value) -> bool:
    *parents, last = path.split(".")
    for k in parents:
        if not isinstance(d.get(k), dict):
            return False            # the section is absent: nothing to fill
        d = d[k]
    d[last] = value
    return True


def find_auto(d, path=""):
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out += find_auto(v, f"{path}.{k}" if path else k)
    elif d == "auto":
        out.append(path)
    return out


def batch_sizes(raw: dict, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro, accumulation) by DeepSpeed's rule; "auto" counts as absent."""
    tb, mb, ga = (None if raw.get(k) in (None, "auto") else raw[k] for k in BATCH)
    for k, v in zip(BATCH, (tb, mb, ga)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"config key {k!r} = {v!r} is invalid; allowed: a positive int")
    if tb is not None and mb is not None and ga is None:
        ga = tb // (mb * world_size)
    elif tb is not None and ga is not None and mb is None:
        mb = tb // (ga * world_size)
    elif tb is None and mb is not None:
        ga = ga or 1
        tb = mb * ga * world_size
    elif tb is not None and mb is None:
        ga, mb = 1, tb // world_size
    elif tb is None:
        raise ValueError("config needs 'train_batch_size' or 'train_micro_batch_size_per_gpu' "
                         "(train_batch_size = micro_batch × gradient_accumulation_steps × world_size)")
    if mb < 1 or ga < 1 or tb != mb * ga * world_size:
        raise ValueError(f"batch sizes inconsistent with world_size {world_size}: train_batch_size={tb} must equal "
                         f"train_micro_batch_size_per_gpu={mb} × gradient_accumulation_steps={ga} × world_size="
                         f"{world_size} = {mb * ga * world_size}")
    return tb, mb, ga


def resolve_auto(raw: dict, world_size: int, known: dict | None = None) -> tuple[dict, list[tuple]]:
    """(a copy of raw with no "auto" left, rows (path, in the JSON, value, why)); `raw` is untouched."""
    cfg, rows, known = copy.deepcopy(raw), [], dict(known or {})
    tb, mb, ga = batch_sizes(cfg, world_size)
    why = {"train_batch_size": f"micro {mb} x accumulation {ga} x world {world_size}",
           "train_micro_batch_size_per_gpu": f"train_batch_size {tb} / (accumulation {ga} x world {world_size})",
           "gradient_accumulation_steps": f"train_batch_size {tb} / (micro {mb} x world {world_size})"}
    for k, v in zip(BATCH, (tb, mb, ga)):
        if cfg.get(k) in (None, "auto"):
            rows.append((k, "auto" if cfg.get(k) == "auto" else "(absent)", v, why[k]))
        cfg[k] = v
    for path, (value, why_) in known.items():
        was = _get(cfg, path)
        if was in ("auto", "(absent)") and _put(cfg, path, value):
            rows.append((path, str(was), value, why_))
    for path in find_auto(cfg):
        if path == "scheduler.params.warmup_max_lr":
            value, why_ = _get(cfg, "optimizer.params.lr"), "= optimizer lr"
            if value in ("auto", "(absent)"):
                value, why_ = DEFAULTS["optimizer.params.lr"][0], "= optimizer lr (its default)"
        elif path == "optimizer.params.weight_decay":
            value, why_ = weight_decay_default(cfg.get("optimizer", {})), "DeepSpeed's optimizer class default"
        elif path in DEFAULTS:
            value, why_ = DEFAULTS[path]
        else:
            continue
        _put(cfg, path, value)
        rows.append((path, "auto", value, why_))
    left = find_auto(cfg)
    if left:
        raise ValueError(f'"auto" values this run cannot resolve: {left}; give them numbers')
    return cfg, rows
