"""Loading DeepSpeed's universal checkpoint: "checkpoint": {"load_universal": true} at any N and ZeRO stage 1-3.

    python -m zero_from_scratch.as_deepspeed.ds_to_universal --input_folder ckpt/global_step3 \\
        --output_folder ckpt/global_step3_universal          # writes ckpt/latest_universal too
    engine = initialize(..., config={..., "checkpoint": {"load_universal": True}})
    engine.load_checkpoint("ckpt")                           # reads latest_universal, re-cut for this N

The folder (layout: checkpoint_universal_layout.py) holds every parameter's full fp32 value and Adam moments;
this rank's shards are cut from them by checkpoint_read.apply_full, the same re-partitioning that
load_checkpoint(reshard=True) uses, so any data-parallel N, stage 1-3, fp32 or bf16 (the fp32 value is the
master; the bf16 weights are its rounding). What is restored follows DeepSpeed 0.19.8 (runtime/engine.py
load_checkpoint / _load_checkpoint / _load_zero_checkpoint and the optimizers' _load_universal_checkpoint):
  * tag=None reads `latest_universal` (absent: DeepSpeed's ValueError); the model-states file is the one
    DeepSpeed's glob finds for this engine's stage (ZeRO-3: zero_pp_rank_0_mp_rank_*, else mp_rank_*)
  * ZeRO-1/2: weights, moments, each group's step (its step.pt) and hyper-parameters (every saved key but the
    params, checkpoint_read.loaded_hyper; groups zipped in order, empty ones skipped as DeepSpeed drops them), loss scale and
    gradient_clipping from zero/optimizer_state.pt — even with load_optimizer_states=False, as DeepSpeed's
    stage_1_and_2._load_universal_checkpoint ignores that flag
  * ZeRO-3: load_optimizer_states=True as above except the step and hyper-parameters of the checkpoint's
    FIRST group go to every group (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3); False:
    the weights alone
  * the lr scheduler (if load_lr_scheduler_states), global_steps, global_samples, skipped_steps from the model
    file; buffers, frozen parameters and the RNG are NOT restored (DeepSpeed skips the module state dict
    in universal mode); client state: the model file's other keys, as DeepSpeed returns them
DeepSpeed's ZeRO-3 load hands every sub-group (a param group cut every sub_group_size elements) the SAME step
object (state[0]["step"]). Where it is a tensor (torch's Adam saved it) each sub-group's `+= 1` is in place, so
the count advances once per sub-group per step: sub-group i of G steps with base + i + 1 and all read base + G
after it. Where it is an int (FusedAdam, DeepSpeedCPUAdam) `+= 1` rebinds each sub-group's own entry: one step
per group, as ringzero keeps anyway. Under the runner (engine.ds_shared_step, quirks.py) ringzero
does the same where each group is one sub-group (engine/step.py: shared_step_turns). Where a group is cut into
several sub-groups (each piece at its own count), and at ringzero's own entry point, it keeps one step per group
and warns on rank 0 that DeepSpeed's later losses differ (tests/test_checkpoint_universal.py shows both).
Refused, one line each: ZeRO stage 0 (DeepSpeed reads a universal folder only through a ZeRO optimizer; its
stage-0 engine would call the torch optimizer's load_state_dict on the model file's None) and model
parallelism (an mpu: DeepSpeed would cut each tensor-parallel slice with AutoTP metadata ringzero lacks).
Cost: every rank reads each parameter's 3-4 files (O(Ψ) memory transiently), no communication.
"""
from __future__ import annotations

import glob
import os
import warnings

import torch

from zero_from_scratch.engine.checkpoint_ds import nonempty_groups
from zero_from_scratch.engine.checkpoint_read import CheckpointError, apply_full, loaded_hyper
from zero_from_scratch.engine.checkpoint_universal_layout import LATEST, PARAM, param_file
from zero_from_scratch.engine.ds_pickle import load_file
from zero_from_scratch.engine.mpu import engine_mp

# what DeepSpeed's _load_checkpoint leaves out of the client state it returns (runtime/engine.py)
DS_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd")


def wanted(engine) -> bool:
    """True when the config asks for DeepSpeed's universal load (checkpoint.load_universal)."""
    raw = getattr(engine.config, "raw", None) or {}
    return bool((raw.get("checkpoint") or {}).get("load_universal", False))


def _tag(load_dir: str, tag) -> str:
    if tag is not None:
        return str(tag)
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        raise ValueError(f"Invalid for universal checkpoint: {path} does not exist")
    with open(path) as f:
        return f.read().strip()


def _model_file(engine, d: str) -> str:
    pattern = "zero_pp_rank_0_mp_rank_*_model_states.pt" if engine.stage_id == 3 else "mp_rank_*_model_states.pt"
    found = sorted(glob.glob(os.path.join(d, pattern)))
    if not found:
        raise CheckpointError(f"{d} has no {pattern}: DeepSpeed's ZeRO-{engine.stage_id} engine reads its counters "
                              "and scheduler there (a universal folder converted from a ZeRO-"
                              f"{'1/2' if engine.stage_id == 3 else '3'} checkpoint, or not a universal folder)")
    return found[0]


def _read(d: str, name: str, state: str, numel: int) -> torch.Tensor | None:
    """One parameter's full state as a flat fp32 tensor (a ZeRO-1/2 source's dict or a ZeRO-3 bare tensor)."""
    path = param_file(d, name, state)
    if not os.path.isfile(path):
        return None
    t = load_file(path)
    t = (t[PARAM] if isinstance(t, dict) else t).reshape(-1).float()
    if t.numel() != numel:
        raise CheckpointError(f"{path} holds {t.numel()} elements; parameter {name!r} here has {numel}")
    return t


def _numels(engine) -> dict:
    lay = engine.layout
    return {s.name: s.numel for u in lay.units for s in u.slots}


def load(engine, load_dir: str, tag, load_optimizer_states: bool, load_lr_scheduler_states: bool):
    rank, stage = engine.comm.global_rank, engine.stage_id
    if stage == 0:
        raise NotImplementedError(f"rank {rank}: checkpoint.load_universal at ZeRO stage 0 is not served: DeepSpeed "
                                  "reads a universal folder only through its ZeRO optimizers (stages 1-3); its stage-0 "
                                  "engine loads no weights and fails on the model file's optimizer (None). Use stage "
                                  "1-3, or load_checkpoint(reshard=True) on ringzero's own folder")
    if engine_mp(engine)[1] > 1:
        raise NotImplementedError(f"rank {rank}: checkpoint.load_universal with model parallelism is not served: "
                                  "DeepSpeed would cut each tensor-parallel slice by its AutoTP metadata; ringzero "
                                  "refuses AutoTP training, so its universal loads are data-parallel only")
    d = os.path.join(load_dir, _tag(load_dir, tag))
    model_path = _model_file(engine, d)
    model = load_file(model_path)
    opt_path = os.path.join(d, "zero", "optimizer_state.pt")
    if not os.path.isfile(opt_path):     # DeepSpeed's assertion text (runtime/base_optimizer.py)
        raise AssertionError(f"{opt_path} containing optimizer global state is missing! Cannot proceed.")
    osd = load_file(opt_path)
    states = stage <= 2 or load_optimizer_states            # see the module docstring: DeepSpeed's rule
    full, numels = {}, _numels(engine)
    for name in engine.params_by_name:
        fp32 = _read(d, name, "fp32", numels[name])
        if fp32 is None:
            raise CheckpointError(f"rank {rank}: universal checkpoint {d} has no {param_file(d, name, 'fp32')} "
                                  f"for parameter {name!r}: from another model")
        full[name] = {"param": fp32, "master": fp32}
        for k in engine.optimizer.STATE if states else ():
            t = _read(d, name, k, numels[name])
            if t is not None:
                full[name][k] = t
    groups = engine.optimizer.param_groups
    hyper, steps, first = [{} for _ in groups], [s["step"] for s in engine.optimizer.state], None
    saved = osd.get("param_groups") or []
    if states and stage <= 2:
        for g, h in zip(nonempty_groups(engine), saved):
            hyper[g] = loaded_hyper(engine, h)
            found = [_step(d, n) for n in engine.group_names[g]]
            found = [s for s in found if s is not None]
            assert all(s == found[0] for s in found), f"Steps {found} are not equal"
            steps[g] = found[0] if found else steps[g]
    elif states and saved:
        first = osd["optimizer_state_dict"]["state"][0].get("step")
        hyper = [loaded_hyper(engine, saved[0]) for _ in groups]
        steps = [int(first) if first is not None else s for s in steps]
    scale = osd.get("loss_scaler")
    cur = scale.get("cur_scale") if isinstance(scale, dict) else getattr(scale, "cur_scale", None)
    man = {"optimizer": {"hyper": hyper, "steps": steps},
           "scheduler": model.get("lr_scheduler") if load_lr_scheduler_states else None,
           "global_steps": model["global_steps"], "skipped_steps": model.get("skipped_steps", 0),
           "micro_steps": model["global_steps"] * engine.config.gradient_accumulation_steps,
           "global_samples": model.get("global_samples"),
           "loss_scaler": {"cur_scale": cur if states and cur is not None else engine.loss_scaler.cur_scale}}
    shared = _shared_step_order(engine, numels, first) if stage == 3 and states else None
    apply_full(engine, full, man, None, states, load_lr_scheduler_states)
    if shared is not None:
        engine.optimizer.shared_step = shared
    if stage <= 2 and osd.get("clip_grad") is not None:     # stage_1_and_2._load_global_state takes it
        engine.config.gradient_clipping = float(osd["clip_grad"])
    engine.stage.zero_grad()
    drop = set(DS_STATES) | ({"lr_scheduler"} if load_lr_scheduler_states else set()) | (
        {"optimizer"} if load_optimizer_states else set())
    return model_path, {k: v for k, v in model.items() if k not in drop}


def _shared_step_order(engine, numels: dict, step):
    """The groups that share DeepSpeed's one step tensor, in its stepping order (None: nothing shared), at a ZeRO-3
    load of optimizer states whose first saved step is `step`; see the module docstring. Only a tensor step is
    shared (an int's `+= 1` rebinds per sub-group). Where one step per group cannot follow DeepSpeed (outside
    the runner, or a group DeepSpeed cuts into several sub-groups, each piece at its own count) rank 0 warns."""
    if not torch.is_tensor(step):
        return None
    order, subs = nonempty_groups(engine), _ds_sub_groups(engine, numels)
    if subs <= 1:
        return None
    runner = getattr(engine, "ds_shared_step", False)
    if runner and subs == len(order):
        return order
    if engine.comm.global_rank == 0:
        why = (f"a group larger than zero_optimization.sub_group_size ({engine.config.sub_group_size}) steps in "
               "pieces, each at its own count of it, which " if runner else "")
        warnings.warn(f"universal load at ZeRO-3: DeepSpeed would give its {subs} sub-groups one shared step tensor, "
                      f"which its Adam then advances once per sub-group each step; {why}ringzero keeps one step per "
                      "group, so the resumed losses differ from DeepSpeed's", stacklevel=4)
    return None


def _ds_sub_groups(engine, numels: dict) -> int:
    """How many sub-groups DeepSpeed's ZeRO-3 optimizer cuts the trainable groups into (stage3.py
    _create_fp16_sub_groups: whole parameters, by each one's partition numel, a sub-group closed once it
    reaches sub_group_size; a group within sub_group_size is one)."""
    size, n, count = engine.config.sub_group_size, engine.comm.size, 0
    for names in filter(None, engine.group_names):
        parts = [-(-numels[name] // n) for name in names]
        if size is None or size >= sum(parts):
            count += 1
            continue
        run = 0
        for i, k in enumerate(parts):
            run += k
            if run >= size or i == len(parts) - 1:
                count, run = count + 1, 0
    return count


def _step(d: str, name: str):
    path = param_file(d, name, "step")
    return int(load_file(path)) if os.path.isfile(path) else None

