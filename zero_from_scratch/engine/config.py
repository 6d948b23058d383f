"""DeepSpeed's JSON config → small dataclasses (the subset ZeRO needs).

    python -c "from zero_from_scratch.engine.config import load_config; print(load_config({'train_batch_size': 8}, world_size=2))"

Spellings as DeepSpeed 0.19.8 accepts them: optimizer "type" in any letter case ("adamw"); the
old "bfloat16" section for "bf16"; `"zero_optimization": true` (stage 1); each stage3_* key
also without its prefix; offload off when absent, null, false or {"device": "none"}. Defaults
are DeepSpeed's where we claim its semantics (gradient_clipping 1.0 when absent).
Rules, as DeepSpeed applies them: train_batch_size = micro_batch × gradient_accumulation × N
(any two determine the third; all three must agree). Unknown keys: one warning listing them.
Invalid values: ValueError naming the key and what is allowed. "auto" (the HF Trainer's
placeholder) is resolved to the default below and printed once on rank 0, because DeepSpeed's
silent resolutions are a classic trap (fp16 "auto" is *off*).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

from zero_from_scratch.engine.auto import BATCH, DEFAULTS, resolve_auto, weight_decay_default
from zero_from_scratch.engine.zero_keys import KEY_STATUS, value_notes, offloads, zero_key_notes, zero_overlap_keys
from zero_from_scratch.engine.key_status import gate, suggest as _suggest
from zero_from_scratch.engine.mixed_cast import DataTypes
from zero_from_scratch.engine.monitor import parse as parse_monitors
from zero_from_scratch.engine.activation_checkpointing import parse as parse_ac
from zero_from_scratch.engine.wall_clock import parse as parse_instruments
from zero_from_scratch.engine.grad_keys import Reduction, parse as parse_reduction, predivide_ignored
from zero_from_scratch.engine.zeropp import ZeroPP, check as check_zeropp
from zero_from_scratch.engine.offload import parse as parse_offload
from zero_from_scratch.engine.param_offload import parse as parse_offload_param
from zero_from_scratch.engine.lr_schedules import VALID_LR_SCHEDULES, SCHEDULE_KEYS
from zero_from_scratch.engine.checkpoint_read import tag_validation_mode
from zero_from_scratch.engine.client_optim import DEFAULTS as OPT_DEFAULTS, SAME_MATHS, OptimizerConfig, surface_keys

KNOWN_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "optimizer", "scheduler", "gradient_clipping", "bf16", "fp16", "zero_optimization",
             # what each of these does here: zero_keys.KEY_STATUS; the gradient reduction's: grad_keys.py
             "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "gradient_allreduce_op",
             "prescale_gradients", "gradient_predivide_factor", "communication_data_type", "seed",
             "dump_state", "tensorboard", "comms_logger", "flops_profiler", "checkpoint",
             "bfloat16", "csv_monitor", "activation_checkpointing"}   # bfloat16: DeepSpeed's older name for "bf16"
KNOWN_ZERO = {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
              "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
              "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
              "stage3_max_live_parameters", "stage3_max_reuse_distance",
              "stage3_gather_16bit_weights_on_model_save", "sub_group_size", "offload_optimizer", "offload_param",
              "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", "zero_hpz_partition_size"}
# DeepSpeed's ZeRO config accepts each stage-3 field under its own name too (pydantic aliases)
ZERO_ALIASES = {k[len("zero_optimization.stage3_"):]: k[len("zero_optimization."):] for k in KEY_STATUS
                if k.startswith("zero_optimization.stage3_")}
KNOWN_ZERO |= set(ZERO_ALIASES)
KNOWN_FP16 = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "auto_cast"}
KNOWN_OPT = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction"}
KNOWN_OPT |= {k for d in OPT_DEFAULTS.values() for k in d} | SAME_MATHS     # Lion/SGD/Adagrad (client_optim.py)
KNOWN_SCHED = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
               "last_batch_iteration"} | SCHEDULE_KEYS

def _bad(key, value, allowed):
    return ValueError(f"config key {key!r} = {value!r} is invalid; allowed: {allowed}")


@dataclass
class SchedulerConfig:
    type: str = "WarmupLR"         # lr_schedules.VALID_LR_SCHEDULES
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None     # None: the optimizer's lr
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    total_num_steps: int | None = None
    params: dict = field(default_factory=dict)   # the section's params (WarmupCosineLR, OneCycle, LRRangeTest)

    def __post_init__(self):
        if self.type not in VALID_LR_SCHEDULES:   # DeepSpeed would also take torch.optim.lr_scheduler's names
            raise _bad("scheduler.type", self.type, VALID_LR_SCHEDULES)
        if self.type not in ("WarmupLR", "WarmupDecayLR"):
            return
        if self.warmup_type not in ("log", "linear"):
            raise _bad("scheduler.params.warmup_type", self.warmup_type, ["log", "linear"])
        if not isinstance(self.warmup_num_steps, int) or self.warmup_num_steps <= 0:
            raise _bad("scheduler.params.warmup_num_steps", self.warmup_num_steps, "a positive int")
        if self.type == "WarmupDecayLR" and not isinstance(self.total_num_steps, int):
            raise _bad("scheduler.params.total_num_steps", self.total_num_steps, "an int (WarmupDecayLR needs it)")


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0        # 0 = dynamic
    initial_scale_power: int = 16  # dynamic scale starts at 2**power
    loss_scale_window: int = 1000  # clean steps before the scale doubles
    hysteresis: int = 2            # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self):
        if self.loss_scale < 0:
            raise _bad("fp16.loss_scale", self.loss_scale, "0 (dynamic) or a positive number")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise _bad("fp16.loss_scale_window/hysteresis", (self.loss_scale_window, self.hysteresis), "ints >= 1")


@dataclass
class ZeroConfig:
    stage: int = 0
    reduce_bucket_size: int = 500_000_000     # elements per gradient bucket (stages 1-2)
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False                # gradient reduce-scatters start from the hooks (see ZERO_KEYS)
    contiguous_gradients: bool = True         # reuse preallocated bucket buffers (see ZERO_KEYS)
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    # ---- overlap / prefetch keys (what each does: zero_keys.ZERO_KEYS)
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    reduce_scatter: bool = True
    explicit: tuple = ()                      # zero_optimization keys the user wrote (for zero_key_notes)
    notes: tuple = ()                         # warnings the engine prints at initialise (zero_key_notes)
    zero_hpz_partition_size: int = 1          # ZeRO++ hpZ (hpz.py): secondary weight shards in groups of this many ranks

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise _bad("zero_optimization.stage", self.stage, [0, 1, 2, 3])
        for k in ("reduce_bucket_size", "allgather_bucket_size"):
            if int(getattr(self, k)) < 1:
                raise _bad(f"zero_optimization.{k}", getattr(self, k), "a positive number of elements")
            setattr(self, k, int(getattr(self, k)))
        if self.stage in (1, 2) and self.allgather_bucket_size % 2:   # DeepSpeed's assertion (stage_1_and_2.py)
            raise AssertionError("allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2 "
                                 f"(zero_optimization.allgather_bucket_size = {self.allgather_bucket_size})")
        for k in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                  "stage3_max_live_parameters", "stage3_max_reuse_distance"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or int(v) != v:
                raise _bad(f"zero_optimization.{k}", v, "an int >= 0 (elements)")
            setattr(self, k, int(v))


@dataclass
class ZeroRunConfig:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = 1.0     # DeepSpeed's default (GRADIENT_CLIPPING_DEFAULT); 0 = off
    bf16: bool = False
    fp16: FP16Config = field(default_factory=FP16Config)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    resolved_auto: dict = field(default_factory=dict)   # key -> value "auto" became
    monitor: dict = field(default_factory=dict)         # section -> monitor.MonitorConfig
    activation_checkpointing: dict | None = None        # the raw section (activation_checkpointing.py)
    offload_optimizer: dict | None = None               # offload.parse: {"device", "nvme_path"} or None
    offload_param: dict | None = None                   # param_offload.parse: the offload_param section or None
    sub_group_size: int = 1_000_000_000                 # elements per offloaded step chunk (DeepSpeed's default)
    zeropp: ZeroPP = field(default_factory=ZeroPP)      # ZeRO++ qwZ / qgZ switches (zeropp.py)
    unknown_keys: list = field(default_factory=list)
    reduction: Reduction = field(default_factory=Reduction)   # grad_keys.py: mean/sum, pre/post division
    instruments: dict = field(default_factory=lambda: parse_instruments({}))   # wall_clock.py
    surface: dict = field(default_factory=lambda: surface_keys({}))   # client_optim.SURFACE_KEYS
    raw: dict = field(default_factory=dict)             # the JSON with "auto" resolved
    tag_validation: str | None = None                   # checkpoint.tag_validation: WARN/IGNORE/FAIL, None = refuse

    def get(self, key: str, default=None):
        """DeepSpeed's engine.config is the config dict (runtime/engine.py): clients such as the HF
        Trainer read it by key, e.g. engine.config.get("zero_optimization", {}).get("stage")."""
        return self.raw.get(key, default)

    def __getitem__(self, key: str):
        return self.raw[key]

    def __post_init__(self):
        if self.bf16 and self.fp16.enabled:
            raise ValueError("config keys 'bf16.enabled' and 'fp16.enabled' are both true; enable at most one")
        if self.gradient_clipping < 0:
            raise _bad("gradient_clipping", self.gradient_clipping, "a number >= 0 (0 = off)")


def unknown_keys(raw: dict) -> list[str]:
    """Every key, at any level we read, that this toolkit does not know: DeepSpeed ignores unknown
    top-level keys without a word, so a typo (`gradient_cliping`) would silently change nothing."""
    out = [k for k in raw if k not in KNOWN_TOP]
    sections = (("optimizer", {"type", "params"}), ("optimizer.params", KNOWN_OPT), ("scheduler", {"type", "params"}),
                ("scheduler.params", KNOWN_SCHED), ("zero_optimization", KNOWN_ZERO), ("fp16", KNOWN_FP16),
                ("bf16", {"enabled"}), ("bfloat16", {"enabled"}))
    for path, known in sections:
        d = raw
        for k in path.split("."):
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, dict):
            out += [f"{path}.{k}" for k in d if k not in known]
    return out


def suggest(key: str) -> str:
    """' (did you mean X?)' for a near miss of a known key, else ''."""
    return _suggest(key, KNOWN_TOP | KNOWN_ZERO | KNOWN_OPT | KNOWN_SCHED)


def load_config(config, world_size: int) -> ZeroRunConfig:
    """Parse a DeepSpeed config (path to JSON or dict) for `world_size` ranks."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {str(config)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {str(config)!r} is not valid JSON: {e}") from None
    elif isinstance(config, dict):
        raw = json.loads(json.dumps(config))        # deep copy, and rejects non-JSON values
    else:
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")
    known = gate(raw, KEY_STATUS, {f"zero_optimization.{a}": f"zero_optimization.{k}" for a, k in ZERO_ALIASES.items()})
    unknown = [k for k in unknown_keys(raw) if k not in known]     # the table's own warning named them
    raw, rows = resolve_auto(raw, world_size)
    resolved = {path: value for path, was, value, _ in rows if was == "auto"}
    tb, mb, ga = (raw[k] for k in BATCH)

    o = raw.get("optimizer", {"type": "AdamW", "params": {}})
    op = o.get("params", {})
    typ = o.get("type", "AdamW")
    opt = OptimizerConfig(type=typ, lr=op.get("lr", 1e-3),
                          betas=tuple(op.get("betas", (0.9, 0.999))),
                          eps=op.get("eps", 1e-8),
                          weight_decay=op.get("weight_decay", weight_decay_default(o)),
                          adam_w_mode=bool(op.get("adam_w_mode", True)), bias_correction=bool(op.get("bias_correction", True)),
                          params=op)
    if "bias_correction" in op and op.get("torch_adam"):   # DeepSpeed: torch.optim.AdamW(bias_correction=) TypeError
        raise ValueError("config key 'optimizer.params.bias_correction' is refused with torch_adam: true (DeepSpeed "
                         "passes it to torch.optim.Adam(W), which raises TypeError); drop one of them")

    sched = None
    if raw.get("scheduler"):
        s = raw["scheduler"]
        sp = s.get("params", {})
        maxlr = sp.get("warmup_max_lr")
        total = sp.get("total_num_steps")
        sched = SchedulerConfig(type=s.get("type", "WarmupLR"),
                                warmup_min_lr=sp.get("warmup_min_lr", 0.0),
                                warmup_max_lr=maxlr, total_num_steps=total,
                                warmup_num_steps=sp.get("warmup_num_steps", 1000),
                                warmup_type=sp.get("warmup_type", "log"), params=sp)

    z = raw.get("zero_optimization", {})
    if isinstance(z, bool):                     # DeepSpeed's deprecated form: true = stage 1
        z = {"stage": int(z)}
    z = {ZERO_ALIASES.get(k, k): v for k, v in z.items()}
    on = offloads(z)                            # every spelling DeepSpeed reads as "offload on"
    refused = [k for k in on if not k.startswith(("zero_optimization.offload_optimizer", "zero_optimization.offload_param"))]
    if refused:
        raise ValueError(f"config keys {refused} are DeepSpeed's deprecated cpu_offload flags, which this engine does not "
                         'read; allowed: offload_optimizer / offload_param {"device": "cpu"|"nvme"}')
    z_off = {k: v for k, v in z.items() if k not in ("offload_param", "cpu_offload", "cpu_offload_param")}
    if not any(k.startswith("zero_optimization.offload_optimizer") for k in on):
        z_off.pop("offload_optimizer", None)    # absent, null, false, {} or {"device": "none"}: off
    else:    # the gate judged super_offload (refused when set), cpuadam_cores_perc (warned)
        z_off["offload_optimizer"] = {k: v for k, v in z_off["offload_optimizer"].items() if k not in ("super_offload", "cpuadam_cores_perc")}
    offload = parse_offload(z_off)
    sub_group_size = z.get("sub_group_size", 1_000_000_000)
    if not isinstance(sub_group_size, (int, float)) or sub_group_size < 1:
        raise _bad("zero_optimization.sub_group_size", sub_group_size, "a positive number of elements")
    zero = ZeroConfig(stage=z.get("stage", 0),
                      reduce_bucket_size=z.get("reduce_bucket_size", 500_000_000),
                      allgather_bucket_size=z.get("allgather_bucket_size", 500_000_000),
                      zero_hpz_partition_size=z.get("zero_hpz_partition_size", 1),
                      **zero_overlap_keys(z, resolved))
    zero.notes = tuple(zero_key_notes(z, zero))
    zeropp = check_zeropp(zero, z, world_size)    # ZeRO++ hpZ, qwZ, qgZ (zeropp.py)

    f = raw.get("fp16", {})
    fp16 = FP16Config(enabled=bool(f.get("enabled", False)),
                      loss_scale=float(f.get("loss_scale", 0.0)),
                      initial_scale_power=int(f.get("initial_scale_power", 16)),
                      loss_scale_window=int(f.get("loss_scale_window", 1000)),
                      hysteresis=int(f.get("hysteresis", 2)),
                      consecutive_hysteresis=bool(f.get("consecutive_hysteresis", False)),
                      min_loss_scale=float(f.get("min_loss_scale", 1.0)))
    b = raw.get("bf16", raw.get("bfloat16", {}))
    bf16 = bool(b.get("enabled", False))
    clip = raw.get("gradient_clipping", DEFAULTS["gradient_clipping"][0])
    if not isinstance(clip, (int, float)):
        raise _bad("gradient_clipping", clip, "a number >= 0 (0 = off)")
    cfg = ZeroRunConfig(tb, mb, ga, opt, sched, float(clip), bf16, fp16, zero, resolved, unknown_keys=unknown, raw=raw)
    cfg.monitor, cfg.tag_validation = parse_monitors(raw), tag_validation_mode(raw)
    vars(cfg).update(vars(DataTypes(raw)))        # param_dtype, buffer_dtype, keep_in_fp32_modules (mixed_cast.py)
    cfg.offload_optimizer, cfg.sub_group_size, cfg.zeropp = offload, int(sub_group_size), zeropp
    cfg.offload_param = parse_offload_param(z, zero.stage)      # param_offload.py (stage 3)
    cfg.activation_checkpointing = parse_ac(raw)
    cfg.instruments, cfg.surface = parse_instruments(raw), surface_keys(raw)
    dt = "bf16" if bf16 else "fp16" if fp16.enabled else "fp32"
    cfg.reduction = parse_reduction(raw, zero.stage, zero.reduce_scatter, dt, world_size)
    zero.notes += tuple(n for n in [predivide_ignored(raw, zero.stage, zero.reduce_scatter),
                                    value_notes(raw, dt, zero.stage)] if n)
    if unknown:
        warnings.warn("zero_from_scratch: unknown config keys ignored: " + ", ".join(k + suggest(k) for k in unknown),
                      stacklevel=2)
    return cfg
