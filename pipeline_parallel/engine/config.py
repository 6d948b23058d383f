"""DeepSpeed's JSON, read for a pipeline: the ZeRO engine's parser plus a "pipeline" section.

    python -c "from pipeline_parallel.engine.config import load; print(load({'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 4}, dp=2))"

    "pipeline": {"schedule": "naive" | "gpipe" | "1f1b" | "interleaved",   (default "1f1b", DeepSpeed's)
                 "virtual_stages": v,                                      (default 1; > 1 needs "interleaved")
                 "clip_norm": "global" | "stage0"}          (default "global"; "stage0": DeepSpeed's fp32 pipeline)

As in DeepSpeed's pipeline engine, train_batch_size = micro_batch × gradient_accumulation_steps × dp
and gradient_accumulation_steps is the number of micro-batches per step. Everything but "pipeline"
goes through zero_from_scratch.engine.config.load_config (one parser, its checks and "auto" rules).
The optimizer (build_optimizer): torch's Adam/AdamW as DeepSpeed's torch_adam, SGD, or Lion (Chen et
al. 2023; DeepSpeed's "Lion" type, FusedLion): c = β1·m + (1 − β1)·g, p ← p·(1 − lr·λ) − lr·sign(c),
m ← β2·m + (1 − β2)·g, one state tensor per parameter (4Ψ bytes where Adam keeps 8Ψ); the update's
one home is zero_from_scratch/engine/optimizers.py::lion_step_, Lion here the torch Optimizer around it.
Refused, as DeepSpeed refuses them with pipelines: ZeRO-2 (a stage produces each gradient m times
per step, so it would reduce m times or keep full gradients anyway) and ZeRO-3 (2m gathers of the
stage's weights per step instead of none: the pipeline's point is that a stage's weights stay put).
KEY_STATUS: every key DeepSpeed 0.19.8's parser accepts and what the pipeline engine does with it —
the ZeRO engine's table (zero_keys.py) with OVERRIDES where the meaning differs here; a key the ZeRO
engine honours with machinery not run here is refused or warned by load() (gate), never silent.
Cost: a dict walk at initialize; per step, a few elementwise passes over Ψ_stage for the optimizer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from pipeline_parallel.schedules import ScheduleError, build
from zero_from_scratch.engine.config import ZeroRunConfig, load_config
from zero_from_scratch.engine.key_status import NOT, SAME, H, R, W, gate
from zero_from_scratch.engine.optimizers import lion_step_
from zero_from_scratch.engine.zero_keys import KEY_STATUS as ZERO_TABLE

__all__ = ["KEY_STATUS", "PipelineRunConfig", "load"]   # KEY_STATUS: tests/test_config_keys.py reads it here

DEFAULT_SCHEDULE = "1f1b"

PNOT = "not done by the pipeline engine; DeepSpeed's pipeline engine would "

OVERRIDES = {
    "steps_per_print": H + "rank 0 prints DeepSpeed's pipeline line 'steps: N loss: … iter time (s): … samples/sec: …' "
                       "every this many steps (DeepSpeed's default 10; here only when set)",
    "dump_state": W + PNOT + "print every engine attribute at initialise",
    "prescale_gradients": W + SAME + "divide gradients by dp before the all-reduce (here: after; same up to rounding)",
    "gradient_predivide_factor": W + SAME + "divide by f before the all-reduce and f/dp after (here: ÷ dp after)",
    "gradient_allreduce_op": "refused when 'sum': the pipeline engine averages gradients over dp (DeepSpeed would "
                             "sum); 'mean' is honoured",
    "gradient_clipping": H + "global norm over every stage (engine/step.py); pipeline.clip_norm 'stage0' gives "
                         "DeepSpeed's fp32 pipeline rule",
    "comms_logger": W + PNOT + "log each collective; engine.step_bytes holds the bytes sent per axis instead",
    "flops_profiler": W + PNOT + "profile one forward's FLOPs per module",
    "wall_clock_breakdown": W + PNOT + "print fwd/bwd/step times; engine.timeline holds every instruction's time",
    "activation_checkpointing": W + PNOT + "configure deepspeed.checkpointing (partition/cpu activations); here "
                                "PipelineModule(activation_checkpoint_interval=k) checkpoints each stage with "
                                "torch.utils.checkpoint",
    "tensorboard": H + "see its keys", "csv_monitor": H + "see its keys",
    **{f"{s}.{k}": H + "zero_from_scratch/engine/monitor.py: lr, loss_scale (fp16), train_loss, grad_norm, "
       "samples_per_sec per step, on rank 0" for s in ("tensorboard", "csv_monitor") for k in ("enabled", "output_path",
                                                                                              "job_name")},
    "fp16.enabled": H + "16-bit stages, fp32 masters, loss scaling (engine/step.py)",
    **{f"fp16.{k}": H + "DeepSpeed's FP16_UnfusedOptimizer scale schedule (engine/step.py)"
       for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale")},
    **{f"fp16.{k}": W + SAME + "ignore it on its unfused fp16 optimizer (torch_adam): no hysteresis on that path"
       for k in ("hysteresis", "consecutive_hysteresis")},
    "bf16.enabled": H + "bf16 stages, fp32 masters (engine/step.py)", "bfloat16.enabled": H + "as bf16.enabled",
    "bf16.immediate_grad_update": W + NOT + "accumulate each micro-batch's gradient into fp32 as it arrives "
                                  "(here gradients accumulate in bf16 over the m micro-batches)",
    "optimizer.type": H + "Adam/AdamW (torch, as torch_adam) or Lion (engine/config.py::Lion)",
    "optimizer.params": H + "Adam: lr, betas, eps, weight_decay, adam_w_mode; Lion: lr, betas, weight_decay",
    "dataloader_drop_last": H + "initialize(training_data=…)'s loader drops the last partial micro-batch",
    "pipeline": H + "schedule, virtual_stages, clip_norm (engine/config.py)",
    "checkpoint.load_universal": R + PNOT + "load_checkpoint from ds_to_universal's folder, re-cut for this run's "
                                 "stages and data ranks (the pipeline engine reads only its own checkpoints)",
    "zero_optimization": H + "see its keys",
    "zero_optimization.stage": H + "0, or 1: optimizer state sharded over the data axis (engine/zero1.py); 2/3 "
                               "refused as DeepSpeed refuses them with pipeline parallelism",
    "zero_optimization.offload_optimizer": "refused when not stage 1 with device cpu (engine/config.py): DeepSpeed "
                                           "offloads only a ZeRO optimizer; honoured at stage 1 (engine/zero1.py)",
}
# every other zero_optimization key the ZeRO engine acts on has nothing to act on at stage 0
for _k, _v in ZERO_TABLE.items():
    if _k.startswith("zero_optimization.") and _k not in OVERRIDES and not _v.startswith((R, W)) \
            and not _k.startswith("zero_optimization.offload_optimizer."):
        OVERRIDES[_k] = W + "no effect: the pipeline engine's ZeRO-1 (engine/zero1.py) has no buckets, overlap or stage 3"
    if _k.startswith(("activation_checkpointing.", "comms_logger.", "flops_profiler.")) and _k not in OVERRIDES:
        OVERRIDES[_k] = W + PNOT + "act on this key (its section is not run here)"

KEY_STATUS = {**ZERO_TABLE, **OVERRIDES}
# what engine/config.py gates: the overrides; every other key reads as honoured here, so the walk
# reaches nested overrides without repeating the ZeRO parser's own refusals and warnings
GATE_TABLE = {k: (v if k in OVERRIDES else H + "the ZeRO parser's table applies") for k, v in KEY_STATUS.items()}


@dataclass
class PipelineRunConfig:
    run: ZeroRunConfig          # batch sizes, optimizer, scheduler, clipping (the shared parser)
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    raw: dict | None = None     # the JSON as given (saved in checkpoints as DeepSpeed's ds_config)
    clip_norm: str = "global"   # "stage0": DeepSpeed's fp32 pipeline clipping (engine/step.py)
    lion: dict | None = None    # Lion's keyword arguments when optimizer.type is "Lion"

    @property
    def micro_batches(self) -> int:
        return self.run.gradient_accumulation_steps


def read_json(config) -> dict:
    """A path to a JSON file, or a dict (deep-copied): the config as a fresh dict."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                return json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {str(config)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {str(config)!r} is not valid JSON: {e}") from None
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")


def load(config, dp: int) -> PipelineRunConfig:
    raw = read_json(config)
    given = json.loads(json.dumps(raw))
    gate(raw, GATE_TABLE, where="pipeline_parallel")
    assert raw.get("managed_gradient_accumulation", True), \
        "managed_gradient_accumulation=False is not supported with pipeline parallelism"   # DeepSpeed's check and words
    if raw.get("gradient_allreduce_op", "mean") != "mean":
        raise ValueError(f"config key 'gradient_allreduce_op' = {raw['gradient_allreduce_op']!r} is refused: the pipeline "
                         "engine averages gradients over the data-parallel replicas (DeepSpeed would sum); allowed: 'mean'")
    pipe = raw.pop("pipeline", {}) or {}
    unknown = set(pipe) - {"schedule", "virtual_stages", "clip_norm"}
    if unknown:
        raise ValueError(f"config section 'pipeline' has unknown keys {sorted(unknown)}; "
                         "allowed: 'schedule', 'virtual_stages', 'clip_norm'")
    clip_norm = pipe.get("clip_norm", "global")
    if clip_norm not in ("global", "stage0"):
        raise ValueError(f"config key 'pipeline.clip_norm' = {clip_norm!r} is invalid; allowed: 'global' (every "
                         "stage's gradients, the default) or 'stage0' (DeepSpeed's fp32 pipeline)")
    lion = None
    if str((raw.get("optimizer") or {}).get("type", "")).lower() == "lion":
        lion = parse_lion(raw.pop("optimizer"))
    schedule, v = pipe.get("schedule", DEFAULT_SCHEDULE), pipe.get("virtual_stages", 1)
    try:           # the schedules' own checks (a known name; v >= 1, and v > 1 only interleaved), at load time
        build(schedule, 0, 1, 1, v)
    except ScheduleError as e:
        raise ValueError(f"config section 'pipeline' = {pipe} is invalid: {e}") from None
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        val = raw.get(key)
        if val is not None and val != "auto" and (not isinstance(val, int) or val < 1):
            raise ValueError(f"config key {key!r} = {val!r} is invalid; allowed: an int >= 1 "
                             "(gradient_accumulation_steps is the number of micro-batches per step)")
    run = load_config(raw, world_size=dp)
    if clip_norm == "stage0" and (run.fp16.enabled or run.bf16):
        raise ValueError("config key 'pipeline.clip_norm' = 'stage0' with bf16/fp16: DeepSpeed's bf16/fp16 optimizers "
                         "clip by every stage's norm; 'stage0' reproduces its fp32 pipeline only; allowed: 'global'")
    if run.zero.stage >= 2:
        raise ValueError(f"config key 'zero_optimization.stage' = {run.zero.stage}: ZeRO-2/3 do not combine with "
                         "pipeline parallelism (DeepSpeed refuses them too): a stage produces each gradient once per "
                         "micro-batch, and ZeRO-3 would re-gather the stage's weights for every micro-batch; allowed: 0 or 1")
    if run.offload_optimizer is not None and (run.zero.stage != 1 or run.offload_optimizer.get("device") != "cpu"):
        raise ValueError(f"config key 'zero_optimization.offload_optimizer' = {run.offload_optimizer} is refused at "
                         f"stage {run.zero.stage}: DeepSpeed offloads only a ZeRO optimizer, and the pipeline engine's "
                         "is stage 1 on the cpu; allowed: stage 1 with {'device': 'cpu'}")
    return PipelineRunConfig(run, schedule, v, given, clip_norm, lion)

LION_KEYS = {"lr", "betas", "weight_decay"}


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0):
        if lr < 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr={lr}, betas={betas}, weight_decay={weight_decay}: need lr >= 0, betas in "
                             "[0, 1), weight_decay >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                lion_step_(p, p.grad, st["exp_avg"], lr, b1, b2, wd)
        return loss


def parse_lion(section: dict) -> dict:
    """The Lion section's params as Lion's keyword arguments; an unknown key is an error naming it."""
    params = dict(section.get("params", {}) or {})
    params.pop("torch_adam", None)
    bad = set(params) - LION_KEYS
    if bad:
        raise ValueError(f"config keys {sorted('optimizer.params.' + k for k in bad)} are not Lion's; "
                         f"allowed: {sorted(LION_KEYS)}")
    return {"lr": float(params.get("lr", 1e-3)), "betas": tuple(params.get("betas", (0.9, 0.999))),
            "weight_decay": float(params.get("weight_decay", 0.0))}


def build_optimizer(cfg, stage_params: list, model_parameters, rank: int):
    """The optimizer over model_parameters (each must be one of this stage's), or over every
    trainable parameter of the stage when model_parameters is None."""
    params = stage_params
    if model_parameters is not None:
        given = list(model_parameters)
        if given and isinstance(given[0], dict):
            raise ValueError(f"rank {rank}: model_parameters as parameter groups (dicts) are not supported by the "
                             "pipeline engine; pass a list of parameters")
        ids = {id(p) for p in stage_params}
        foreign = [tuple(p.shape) for p in given if id(p) not in ids]
        if foreign:
            raise ValueError(f"rank {rank}: model_parameters holds {len(foreign)} tensor(s) (shapes {foreign[:3]}) that "
                             "are not trainable parameters of this rank's stage; pass "
                             "[p for p in model.parameters() if p.requires_grad] taken on this rank")
        params = given
    if getattr(cfg, "lion", None) is not None:
        return Lion(params, **cfg.lion)
    o = cfg.run.optimizer
    if o.type == "SGD":              # DeepSpeed's basic optimizer for it: torch.optim.SGD(params, **config params)
        return torch.optim.SGD(params, **o.params)
    if o.type not in ("Adam", "AdamW") or not o.bias_correction:   # the ZeRO engine's config reader accepts more
        raise ValueError(f"rank {rank}: optimizer {o.type!r}" + ("" if o.bias_correction else " with bias_correction "
                         "false") + " is not served by the pipeline engine (DeepSpeed's would build it on the stage's "
                         "parameters); allowed: Adam, AdamW (bias-corrected), Lion or SGD")
    opt_cls = torch.optim.AdamW if o.adam_w_mode else torch.optim.Adam
    return opt_cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def engine_optimizer(e, model_parameters):
    """The engine's optimizer: ZeRO-1's over this replica's shard, the fp32 masters' (bf16/fp16),
    or the stage's parameters' (fp32)."""
    if e.zero1 is not None:
        given = None if model_parameters is None else {id(p) for p in model_parameters}
        if given is not None and given != {id(p) for p in e.params}:
            raise ValueError(f"rank {e.rank}: with zero_optimization.stage 1 model_parameters must be every trainable "
                             "parameter of the stage (the shard layout covers them all); pass None or all of them")
        return e.zero1.optimizer
    if e.mixed is not None:
        return build_optimizer(e.cfg, e.mixed.master, e.mixed.masters_for(model_parameters), e.rank)
    return build_optimizer(e.cfg, e.params, model_parameters, e.rank)
