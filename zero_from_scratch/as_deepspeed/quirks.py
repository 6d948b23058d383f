"""DeepSpeed 0.19.8's behaviours the runner makes its defaults (ringzero's own entry points keep theirs).

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    (top.initialize calls these around the engine it builds)

deprecated_offload_keys   zero_optimization.cpu_offload: true → offload_optimizer {"device": "cpu"},
        cpu_offload_param: true → offload_param {"device": "cpu"}, false → the key dropped,
        cpu_offload_use_pin_memory dropped; each with DeepSpeed's warning, and its assertion when the
        new key is given too (runtime/config_utils.py::_process_deprecated_field, zero/config.py).
pipeline_defaults         a PipelineModule in fp32: gradient clipping by stage 0's norm on every stage
        (DeepSpeed's fp32 pipeline: runtime/pipe/engine.py leaves clipping to the torch optimizer
        path, whose norm covers the stage's own parameters, broadcast from the first stage), i.e.
        "pipeline": {"clip_norm": "stage0"}, unless the config names a clip_norm itself; and
        pipeline.use_reentrant true unless the config says otherwise (DeepSpeed's default: reentrant
        activation checkpointing, stage 0's floating inputs require grad; engine/activation_checkpointing.py).
train_what_is_given       model_parameters (or a client optimizer object's groups) that leave trainable
        weights out: DeepSpeed's optimizer holds only what it is given, so the others never change; the runner sets requires_grad=False on them
        (the engine then keeps them as frozen weights: same losses, no gradient kept for them) and
        says so once on rank 0.
expose_torch_optimizer    engine.optimizer.optimizer: DeepSpeed's ZeRO / bf16 / fp16 wrappers keep the
        torch optimizer there; ringzero's engine.optimizer is that optimizer (over its shards), so a
        view of it is set there (one without a further .optimizer: unwrapping loops end); its
        state_dict() is torch's format over this rank's shard, as DeepSpeed's holds its partition;
        DeepSpeed's layout names (fp16_groups, the flat fp32 partitions) as views: zero_layout.py; at
        stage 3 DeepSpeedZeroOptimizer_Stage3's isinstance and norm names: zero3_optimizer.py; at stages
        1-2 with offload_optimizer accumulated_grads_in_cpu: accumulated_grads.py.
tag_validation_warn       checkpoint.tag_validation defaults to WARN (runtime/config.py's default): ranks
        saving under different tags are warned, not refused (checkpoint.py::_rank0_tag says where
        the files go).
register_external_on_use  stage 3: a parameter read in the forward of a module that does not hold it is
        registered to that module and gathered (DeepSpeed's ZeROOrderedDict,
        runtime/zero/parameter_offload.py), not refused (external.py, auto_register); every module's
        _parameters a ZeROOrderedDict, as DeepSpeed's (engine/zero_ordered_dict.py). At stage 0 a plain
        loss.backward() raises DeepSpeed's RuntimeError (its torch-style backward needs a ZeROOptimizer).
init_model_below_stage3   a model built under zero.Init, initialized at stage 0-2: DeepSpeed accepts it
        (runtime/engine.py keeps the partitioned parameters, which its stage 0-2 cannot train); the
        runner gathers them whole (every rank) and drops their ZeRO-3 attributes, with one warning,
        where ringzero's own initialize refuses (zero_partition.refuse_below_stage3); inside the
        still-open Init context too (the context then leaves that model whole: zero_partition.make_whole).
offload_param_below_stage3   zero_optimization.offload_param at stage 0-2: DeepSpeed reads it only at
        stage 3 (runtime/zero/config.py; stages 0-2 never look), so the runner drops it with a warning
        where ringzero's own config refuses it.
dp_change_load            a ZeRO checkpoint saved at another data-parallel size (same stage):
        DeepSpeed's engine refuses it with ZeRORuntimeException when load_optimizer_states
        (runtime/engine.py::_load_zero_checkpoint); without them it reads no ZeRO file at any N and
        sets the fp32 master from the loaded 16-bit weights (load_checkpoint →
        optimizer._restore_from_bit16_weights), and so does the runner (checkpoint_read.bit16_master);
        ringzero's own load asks for reshard=True at another N and keeps the saved master
        (engine/checkpoint.py reads engine.ds_dp_change).
lr_on_load                the engine's WarmupLR / WarmupDecayLR: load_checkpoint sets only the scheduler's
        step, as DeepSpeed's load_state_dict (runtime/lr_schedules.py): get_last_lr() keeps its construction
        value until the next step; the lr the resumed step uses is the loaded optimizer's (its construction
        lr with load_optimizer_states=False), as DeepSpeed's; ringzero's own sets the loaded step's lr.
shared_step_load          a ZeRO-3 universal-checkpoint load of optimizer states: every optimizer sub-group gets
        one shared Adam step tensor (runtime/zero/stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3:
        `self.optimizer.state[fp32_param]['step'] = state_step`, the tensor of state[0]), which each sub-group's
        torch Adam step advances in turn; the runner steps the groups the same way (engine.ds_shared_step:
        checkpoint_universal.py, step.py shared_step_turns) until a load of optimizer states gives them their own;
        where a group exceeds sub_group_size (DeepSpeed steps it in pieces) ringzero warns and keeps one step per group.
zero0_wrapper_step        stage 0 in bf16/fp16: the fp32 masters take one optimizer step on zero gradients at
        initialize (step count 1, weight decay once), as DeepSpeed's FP16_UnfusedOptimizer / FP16_Optimizer constructor
        does (runtime/fp16/unfused_optimizer.py and fused_optimizer.py initialize_optimizer_states, reached from
        engine.py _configure_fp16_optimizer); top.initialize builds the engine inside precision.deepspeed_wrappers().
        And the average: the summed gradients × 1/N in the 16-bit dtype, rounded there (engine.py allreduce_bucket),
        not ÷N in fp32 at the step (precision.average_like_deepspeed; the same bits when N is a power of two); the
        norm and clip factor in the wrapper's arithmetic (moe_grads.unfused_norm, precision.deepspeed_multiplier), the
        dynamic fp16 scale updated before the unscale (precision.deepspeed_unscale). In fp16 the runner equals DeepSpeed
        given the scaled loss (zero0_fp16_loss_unscaled); none of this without an optimizer in the config or the call.
zero0_fp16_loss_unscaled  NOT copied: DeepSpeed 0.19.8's engine.backward scales the loss only for a ZeROOptimizer
        (engine.py backward, `if isinstance(self.optimizer, ZeROOptimizer): loss = self.optimizer.scale_if_loss(loss)`),
        which FP16_UnfusedOptimizer / FP16_Optimizer are not, while their step divides by the scale (upstream PR #8393):
        at stage 0 in fp16 its updates are 1/scale too small. The runner scales the loss, as DeepSpeed intends, and
        says so once on rank 0 at initialize (top.initialize).
read_config               a config file read as DeepSpeed reads it: hjson, duplicate keys refused.
prefetch_as_deepspeed     stage 3 with prefetch: DeepSpeed's coordinator order (prefetch.py ds_order):
        prefetch from the forward's start, a unit whose later use a prefetch passed stays gathered
        after its forward (in flight: ds_status INFLIGHT), and prefetch runs without overlap_comm
        too; ringzero's own releases the unit, and prefetches only with overlap_comm.
Cost: a read of the config (JSON) and a walk over named_parameters(), once.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import torch
import torch.distributed as dist

from zero_from_scratch.as_deepspeed import zero3_optimizer, zero_layout, accumulated_grads
from zero_from_scratch.as_deepspeed.utils import logger
from zero_from_scratch.engine.lr_schedules import WarmupLR
from zero_from_scratch.engine.zero_ordered_dict import ensure_zero_ordered_dict
from zero_from_scratch.engine.zero_partition import ZeroParamStatus

_DEPRECATED = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))


def _no_duplicates(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):   # DeepSpeed's message (runtime/config_utils.py::dict_raise_error_on_duplicate_keys)
        keys = [k for k, n in Counter(k for k, _ in pairs).items() if n > 1]
        raise ValueError("Duplicate keys in DeepSpeed config: {}".format(keys))
    return d


def read_config(config):
    """A config file as DeepSpeed reads it (runtime/config.py::DeepSpeedConfig): hjson (JSON's superset:
    comments, unquoted keys, trailing commas), duplicate keys refused; a dict or anything else unchanged."""
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        try:
            import hjson   # on use: DeepSpeed's dependency, not ringzero's
        except ImportError:    # DeepSpeed's own dependency; without it, plain JSON
            hjson = json
        with open(config) as f:
            return hjson.load(f, object_pairs_hook=_no_duplicates)
    return config


def _as_dict(config):
    config = read_config(config)
    return json.loads(json.dumps(config)) if isinstance(config, dict) else config


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def deprecated_offload_keys(config):
    c = _as_dict(config)
    z = c.get("zero_optimization") if isinstance(c, dict) else None
    if not isinstance(z, dict) or not {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"} & set(z):
        return config
    config = c
    for old, new in _DEPRECATED:
        if old in z:
            logger.warning(f"Config parameter {old} is deprecated use {new} instead")
            assert new not in z, f"Cannot provide deprecated parameter '{old}' and replacing parameter '{new}' together"
            if z.pop(old):
                z[new] = {"device": "cpu"}
    if "cpu_offload_use_pin_memory" in z:   # set_new_param=False in DeepSpeed: warned, then read by nothing
        logger.warning("Config parameter cpu_offload_use_pin_memory is deprecated use offload_param or "
                       "offload_optimizer instead")
        z.pop("cpu_offload_use_pin_memory")
    return config


def tag_validation_warn(config):
    c = _as_dict(config)
    if not isinstance(c, dict) or "tag_validation" in (c.get("checkpoint") or {}):
        return config
    c["checkpoint"] = {**(c.get("checkpoint") or {}), "tag_validation": "WARN"}
    return c


def offload_param_below_stage3(config):
    c = _as_dict(config)
    z = c.get("zero_optimization") if isinstance(c, dict) else None
    if not isinstance(z, dict) or z.get("offload_param") is None or z.get("stage", 0) == 3:
        return config
    del z["offload_param"]
    if _rank0():
        logger.warning(f"zero_optimization.offload_param at stage {z.get('stage', 0)}: DeepSpeed offloads parameters "
                       "at stage 3 only and ignores it here; so does the runner")
    return c


def pipeline_defaults(config):
    c = _as_dict(config)
    if not isinstance(c, dict):
        return config
    low = any((c.get(k) or {}).get("enabled") is True for k in ("fp16", "bf16", "bfloat16"))
    pipe = {"use_reentrant": True, **(c.get("pipeline") or {})}
    if not (low or "clip_norm" in pipe):   # DeepSpeed's bf16/fp16 optimizers clip by every stage's norm: ringzero's
        pipe["clip_norm"] = "stage0"
    c["pipeline"] = pipe
    return c


def train_what_is_given(model, model_parameters, source: str = "model_parameters"):
    items = list(model_parameters)
    given = set()
    for it in items:
        given |= {id(p) for p in (it["params"] if isinstance(it, dict) else [it])}
    left = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in given]
    for _, p in left:
        p.requires_grad_(False)
    if left and _rank0():
        names = [n for n, _ in left]
        logger.warning(f"{len(names)} trainable parameters are not in {source} ({', '.join(names[:5])}"
                       f"{', …' if len(names) > 5 else ''}): DeepSpeed's optimizer never updates them; "
                       "ringzero keeps them frozen (requires_grad=False)")
    return items


class TorchOptimizerView:
    """engine.optimizer.optimizer: every attribute read and written on the engine's optimizer."""

    def __init__(self, opt, engine=None):
        object.__setattr__(self, "_opt", opt)
        object.__setattr__(self, "_engine", engine)

    @property
    def state(self):     # keyed by each group's fp32 partition, as DeepSpeed's (zero_layout.py)
        return zero_layout.StateByPartition(self._engine) if self._engine is not None else self._opt.state

    def __getattr__(self, attr):
        if attr == "optimizer":
            raise AttributeError(attr)
        return getattr(object.__getattribute__(self, "_opt"), attr)

    def __setattr__(self, attr, value):
        setattr(self._opt, attr, value)

    def __repr__(self):
        return f"TorchOptimizerView({self._opt!r})"

    def state_dict(self) -> dict:
        """torch's format over this rank's shard, as DeepSpeed's inner optimizer holds its fp32 partition:
        one "parameter" per group (the group's shard), its step and states; at stage 3 between
        _set/_clear_fp32_optimizer_param_groups, DeepSpeed's partition layout (zero3_optimizer.py)."""
        opt = self._opt
        if getattr(opt, "_ringzero_fp32_groups", False):
            return zero3_optimizer.fp32_state_dict(self._engine)
        state = {g: {k: (torch.tensor(float(v)) if k == "step" else v.detach().clone()) for k, v in st.items()}
                 for g, st in enumerate(opt.state)}
        groups = [{**{k: v for k, v in grp.items() if k != "params"}, "params": [g]}
                  for g, grp in enumerate(opt.param_groups)]
        return {"state": state, "param_groups": groups}


def expose_torch_optimizer(engine) -> None:
    opt = getattr(engine, "optimizer", None)
    if opt is None or hasattr(opt, "optimizer"):
        return
    wrapped = any(getattr(engine, f, lambda: False)() for f in ("fp16_enabled", "bfloat16_enabled")) or \
        getattr(engine, "zero_optimization_stage", lambda: 0)() > 0
    if wrapped:     # DeepSpeed at stage 0 in fp32 hands back the torch optimizer itself: no .optimizer there
        opt.optimizer = TorchOptimizerView(opt, engine if hasattr(engine, "group_names") else None)
        if hasattr(engine, "group_names"):   # the ZeRO engine (not the pipeline's): DeepSpeed's layout names
            zero_layout.install(engine)
            zero3_optimizer.install(engine)
            accumulated_grads.install(engine)


def dp_change_load(engine) -> None:
    if hasattr(engine, "group_names"):      # the ZeRO engine (the pipeline's checkpoints are its own)
        engine.ds_dp_change = True


def shared_step_load(engine) -> None:
    if hasattr(engine, "group_names"):      # the ZeRO engine (the pipeline's has no universal load)
        engine.ds_shared_step = True


def lr_on_load(engine) -> None:
    if isinstance(getattr(engine, "lr_scheduler", None), WarmupLR):
        engine.lr_scheduler.apply_on_load = False


def register_external_on_use(engine) -> None:
    if hasattr(engine, "_support_torch_style_backward"):   # DeepSpeed's ZeRO-0 optimizer is no ZeROOptimizer
        engine._support_torch_style_backward = engine.zero_optimization_stage() > 0
    ext = getattr(engine, "external", None)
    if ext is not None and hasattr(ext, "auto_register"):
        ext.auto_register = True
        if engine.zero_optimization_stage() == 3:   # DeepSpeed's _inject_parameters (zero_ordered_dict.py)
            for m in engine.module.modules():
                ensure_zero_ordered_dict(m)


def prefetch_as_deepspeed(engine) -> None:
    stage = getattr(engine, "stage", None)
    pf = getattr(stage, "pf", None)
    if pf is not None:
        pf.ds_order = True
        pf.status = lambda i, name: stage.saved._status(i, getattr(ZeroParamStatus, name))
        if engine.comm.size > 1:    # DeepSpeed prefetches whatever overlap_comm says (ringzero's own: with it)
            pf.budget = engine.config.zero.stage3_prefetch_bucket_size


def init_model_below_stage3(model, config) -> None:
    from zero_from_scratch.engine.zero_partition import held_by_init, make_whole   # only when a script needs it
    c = _as_dict(config)
    stage = ((c.get("zero_optimization") or {}).get("stage", 0) if isinstance(c, dict) else 0)
    held = [(n, p) for n, p in model.named_parameters() if held_by_init(p)]
    if stage == 3 or not held:
        return
    make_whole(model, [p for _, p in held])
    if _rank0():
        logger.warning(f"{len(held)} parameters (e.g. {held[0][0]!r}) were partitioned by zero.Init but "
                       f"zero_optimization.stage is {stage}: DeepSpeed keeps them partitioned; ringzero gathers "
                       "them whole for this stage")
