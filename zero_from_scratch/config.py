"""DeepSpeed's JSON config → small dataclasses (the subset ZeRO needs).

    python -c "from zero_from_scratch.config import load_config; print(load_config({'train_batch_size': 8}, world_size=2))"

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

KNOWN_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "optimizer", "scheduler", "gradient_clipping", "bf16", "fp16", "zero_optimization",
             # accepted and ignored: logging / profiling knobs that do not change the maths
             "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
             "prescale_gradients", "gradient_predivide_factor", "communication_data_type", "seed",
             "dump_state", "tensorboard", "comms_logger", "flops_profiler", "checkpoint",
             "csv_monitor", "activation_checkpointing"}   # honoured: monitor.py, activation_checkpointing.py
KNOWN_ZERO = {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
              "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
              "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
              "stage3_max_live_parameters", "stage3_max_reuse_distance",
              "stage3_gather_16bit_weights_on_model_save", "sub_group_size", "offload_optimizer", "offload_param"}
KNOWN_FP16 = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "auto_cast"}
KNOWN_OPT = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction"}
KNOWN_SCHED = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
               "last_batch_iteration"}

# what "auto" becomes (the values DeepSpeed / the HF Trainer default to)
AUTO = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "gradient_clipping": 0.0,
        "bf16.enabled": False, "fp16.enabled": False, "warmup_min_lr": 0.0, "warmup_num_steps": 1000,
        "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000}


def _bad(key, value, allowed):
    return ValueError(f"config key {key!r} = {value!r} is invalid; allowed: {allowed}")


@dataclass
class OptimizerConfig:
    type: str = "AdamW"            # Adam | AdamW (DeepSpeed's "Adam" is AdamW unless adam_w_mode=false)
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True       # decoupled weight decay (DeepSpeed's default for both types)

    def __post_init__(self):
        if self.type not in ("Adam", "AdamW"):
            raise _bad("optimizer.type", self.type, ["Adam", "AdamW"])
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise _bad("optimizer.params.lr", self.lr, "a number >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise _bad("optimizer.params.betas", self.betas, "two numbers in [0, 1)")
        if not self.eps > 0:
            raise _bad("optimizer.params.eps", self.eps, "a number > 0")
        if self.weight_decay < 0:
            raise _bad("optimizer.params.weight_decay", self.weight_decay, "a number >= 0")
        self.betas = tuple(float(b) for b in self.betas)


@dataclass
class SchedulerConfig:
    type: str = "WarmupLR"         # WarmupLR | WarmupDecayLR
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None     # None: the optimizer's lr
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    total_num_steps: int | None = None

    def __post_init__(self):
        if self.type not in ("WarmupLR", "WarmupDecayLR"):
            raise _bad("scheduler.type", self.type, ["WarmupLR", "WarmupDecayLR"])
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
    overlap_comm: bool = False                # accepted; this engine communicates synchronously
    contiguous_gradients: bool = True         # accepted; gradients always live in flat buffers
    stage3_prefetch_bucket_size: int = 50_000_000      # accepted, not used (no prefetch)
    stage3_param_persistence_threshold: int = 100_000  # accepted, not used (every param is partitioned)

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise _bad("zero_optimization.stage", self.stage, [0, 1, 2, 3])
        for k in ("reduce_bucket_size", "allgather_bucket_size"):
            if int(getattr(self, k)) < 1:
                raise _bad(f"zero_optimization.{k}", getattr(self, k), "a positive number of elements")
            setattr(self, k, int(getattr(self, k)))


@dataclass
class ZeroRunConfig:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = 0.0
    bf16: bool = False
    fp16: FP16Config = field(default_factory=FP16Config)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    resolved_auto: dict = field(default_factory=dict)   # key -> value "auto" became
    monitor: dict = field(default_factory=dict)         # section -> monitor.MonitorConfig
    activation_checkpointing: dict | None = None        # the raw section (activation_checkpointing.py)
    offload_optimizer: dict | None = None               # offload.parse: {"device", "nvme_path"} or None
    sub_group_size: int = 1_000_000_000                 # elements per offloaded step chunk (DeepSpeed's default)
    unknown_keys: list = field(default_factory=list)

    def __post_init__(self):
        if self.bf16 and self.fp16.enabled:
            raise ValueError("config keys 'bf16.enabled' and 'fp16.enabled' are both true; enable at most one")
        if self.gradient_clipping < 0:
            raise _bad("gradient_clipping", self.gradient_clipping, "a number >= 0 (0 = off)")


def _auto(raw: dict, key: str, path: str, default, resolved: dict):
    v = raw.get(key, default)
    if v == "auto":
        v = AUTO.get(path, AUTO.get(key, default))
        resolved[path] = v
    return v


def _batch(raw: dict, world_size: int, resolved: dict) -> tuple[int, int, int]:
    tb, mb, ga = (raw.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps"))
    autos = [k for k, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                            ("gradient_accumulation_steps", ga)) if v == "auto"]
    tb, mb, ga = (None if v == "auto" else v for v in (tb, mb, ga))
    for k, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb), ("gradient_accumulation_steps", ga)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise _bad(k, v, "a positive int")
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga = tb // (mb * world_size)
    elif tb is not None and ga is not None:
        mb = tb // (ga * world_size)
    elif mb is not None and ga is not None:
        tb = mb * ga * world_size
    elif tb is not None:
        ga, mb = 1, tb // world_size
    elif mb is not None:
        ga, tb = 1, mb * world_size
    else:
        raise ValueError("config needs 'train_batch_size' or 'train_micro_batch_size_per_gpu' "
                         "(train_batch_size = micro_batch × gradient_accumulation_steps × world_size)")
    if mb < 1 or ga < 1 or tb != mb * ga * world_size:
        raise ValueError(f"batch sizes inconsistent with world_size {world_size}: train_batch_size={tb} must equal "
                         f"train_micro_batch_size_per_gpu={mb} × gradient_accumulation_steps={ga} × world_size="
                         f"{world_size} = {mb * ga * world_size}")
    for k in autos:
        resolved[k] = {"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb,
                       "gradient_accumulation_steps": ga}[k]
    return tb, mb, ga


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
    resolved: dict = {}
    unknown = [k for k in raw if k not in KNOWN_TOP]
    tb, mb, ga = _batch(raw, world_size, resolved)

    o = raw.get("optimizer", {"type": "AdamW", "params": {}})
    op = o.get("params", {})
    unknown += [f"optimizer.params.{k}" for k in op if k not in KNOWN_OPT]
    unknown += [f"optimizer.{k}" for k in o if k not in ("type", "params")]
    typ = o.get("type", "AdamW")
    opt = OptimizerConfig(type=typ, lr=_auto(op, "lr", "lr", 1e-3, resolved),
                          betas=tuple(_auto(op, "betas", "betas", (0.9, 0.999), resolved)),
                          eps=_auto(op, "eps", "eps", 1e-8, resolved),
                          weight_decay=_auto(op, "weight_decay", "weight_decay", 0.0, resolved),
                          adam_w_mode=bool(op.get("adam_w_mode", True)))

    sched = None
    if raw.get("scheduler"):
        s = raw["scheduler"]
        sp = s.get("params", {})
        unknown += [f"scheduler.params.{k}" for k in sp if k not in KNOWN_SCHED]
        maxlr = sp.get("warmup_max_lr")
        if maxlr == "auto":
            maxlr = resolved["warmup_max_lr"] = opt.lr
        total = sp.get("total_num_steps")
        if total == "auto":
            raise ValueError("config key 'scheduler.params.total_num_steps' is 'auto': there is no trainer here "
                             "to fill it; allowed: an int (the number of optimizer steps)")
        sched = SchedulerConfig(type=s.get("type", "WarmupLR"),
                                warmup_min_lr=_auto(sp, "warmup_min_lr", "warmup_min_lr", 0.0, resolved),
                                warmup_max_lr=maxlr, total_num_steps=total,
                                warmup_num_steps=_auto(sp, "warmup_num_steps", "warmup_num_steps", 1000, resolved),
                                warmup_type=sp.get("warmup_type", "log"))

    z = raw.get("zero_optimization", {})
    unknown += [f"zero_optimization.{k}" for k in z if k not in KNOWN_ZERO]
    from zero_from_scratch.offload import parse as parse_offload   # offload.py; offload_param is refused there
    offload = parse_offload(z)
    sub_group_size = z.get("sub_group_size", 1_000_000_000)
    if not isinstance(sub_group_size, (int, float)) or sub_group_size < 1:
        raise _bad("zero_optimization.sub_group_size", sub_group_size, "a positive number of elements")
    zero = ZeroConfig(stage=z.get("stage", 0),
                      reduce_bucket_size=_auto(z, "reduce_bucket_size", "reduce_bucket_size", 500_000_000, resolved),
                      allgather_bucket_size=_auto(z, "allgather_bucket_size", "allgather_bucket_size", 500_000_000, resolved),
                      overlap_comm=bool(z.get("overlap_comm", False)),
                      contiguous_gradients=bool(z.get("contiguous_gradients", True)))

    f = raw.get("fp16", {})
    unknown += [f"fp16.{k}" for k in f if k not in KNOWN_FP16]
    fp16 = FP16Config(enabled=bool(_auto(f, "enabled", "fp16.enabled", False, resolved)),
                      loss_scale=float(f.get("loss_scale", 0.0)),
                      initial_scale_power=int(f.get("initial_scale_power", 16)),
                      loss_scale_window=int(f.get("loss_scale_window", 1000)),
                      hysteresis=int(f.get("hysteresis", 2)),
                      consecutive_hysteresis=bool(f.get("consecutive_hysteresis", False)),
                      min_loss_scale=float(f.get("min_loss_scale", 1.0)))
    b = raw.get("bf16", {})
    unknown += [f"bf16.{k}" for k in b if k != "enabled"]
    bf16 = bool(_auto(b, "enabled", "bf16.enabled", False, resolved))
    clip = raw.get("gradient_clipping", 0.0)
    if clip == "auto":
        clip = resolved["gradient_clipping"] = AUTO["gradient_clipping"]
    if not isinstance(clip, (int, float)):
        raise _bad("gradient_clipping", clip, "a number >= 0 (0 = off)")
    cfg = ZeroRunConfig(tb, mb, ga, opt, sched, float(clip), bf16, fp16, zero, resolved, unknown)
    from zero_from_scratch.monitor import parse as parse_monitors
    cfg.monitor = parse_monitors(raw)
    cfg.offload_optimizer, cfg.sub_group_size = offload, int(sub_group_size)
    from zero_from_scratch.activation_checkpointing import parse as parse_ac
    cfg.activation_checkpointing = parse_ac(raw)
    if unknown:
        warnings.warn(f"zero_from_scratch: unknown config keys ignored: {', '.join(unknown)}", stacklevel=2)
    return cfg
