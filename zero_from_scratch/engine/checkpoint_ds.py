"""DeepSpeed's checkpoint layout, both ways: every save also writes DeepSpeed 0.19.8's files, so
DeepSpeed's own zero_to_fp32 reads our checkpoints; load_checkpoint reads a folder DeepSpeed wrote.

    engine.save_checkpoint("ckpt")            # ckpt/latest, ckpt/global_stepN/{ours, DeepSpeed's files}
    python ckpt/zero_to_fp32.py ckpt out      # DeepSpeed's script (or deepspeed.utils.zero_to_fp32.*)
    engine.load_checkpoint("ds_ckpt")         # a DeepSpeed checkpoint: weights, Adam states, scheduler, steps

DeepSpeed's files in <tag>/ (checkpoint/constants.py names):
  stage 0-2  mp_rank_00_model_states.pt (rank 0): module, buffer_names, param_shapes (per group),
             frozen_param_shapes/_fragments, shared_params, lr_scheduler, counters, ds_config, ds_version,
             client state; zero_pp_rank_R_mp_rank_00_optim_states.pt (stages 1-2, each rank): each group's
             fp32 vector padded to a multiple of 2N, cut into N partitions (single_partition_of_fp32_groups less
             its padding, base_optimizer_state with it; param_slice_mappings, per-rank group_paddings)
  stage 3    zero_pp_rank_R_mp_rank_00_model_states.pt (each rank; module's parameters size-0, as
             DeepSpeed's partitioned ones; frozen_param_fragments its partitions) and ..._optim_states.pt:
             every parameter padded to a multiple of N, cut into N partitions, rank R's concatenated per
             group (fp32_flat_groups, optimizer_state_dict)
  bf16       optimizer states in bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt, DeepSpeed's name when bf16 is on
             (the only one its bf16 engine's load_checkpoint opens); read_full below globs either name
DeepSpeed's pickled classes (its loss scaler, its ZeroStageEnum) read and write by name through ds_pickle.py, so
the deepspeed package is never imported. Our layout differs (sharding.py's units): a save re-partitions, one all-gather
per unit of the fp32 master and of each optimizer state ((N-1)/N·Ψ per rank per kind); a load reads all files, O(Ψ).
"""
from __future__ import annotations

import glob
import math
import os
from collections import OrderedDict

import torch

from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.checkpoint_read import CheckpointError, apply_full, bit16_master, loaded_hyper, tag_folder
from zero_from_scratch.engine.checkpoint_universal_layout import slice_mappings
from zero_from_scratch.engine.ds_pickle import DS_PICKLE, load_file
from zero_from_scratch.engine.mpu import engine_mp
from zero_from_scratch.engine.safe_api import ds_partition
from zero_from_scratch.engine import z3_ds_tensor

DS_VERSION = "0.19.8"
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
           "ds_version", "checkpoint_parallel_dimensions"}


# ----------------------------------------------------------------------------- writing
def _full_values(engine) -> dict:
    """{name: {"master": fp32, state key: fp32}} of every trained parameter, on every rank."""
    keys = ("master", *engine.optimizer.STATE)
    out: dict = {}
    for u in engine.layout.units:
        sl = slice(u.local_offset, u.local_offset + u.shard)
        for k in keys:
            shard = (engine.master[u.group][sl] if engine.mixed else z3_ds_tensor.master_of(engine, u)) if k == "master" \
                else engine.optimizer.state[u.group][k][sl]
            shard = shard.float().contiguous()
            if engine.stage_id == 0 or engine.comm.size == 1:
                full = shard
            else:
                full = torch.empty(u.padded, dtype=torch.float32, device=engine.device)
                engine.comm.all_gather_single(full, shard, purpose="checkpoint")
            for s in u.slots:
                out.setdefault(s.name, {})[k] = full[s.offset:s.offset + s.numel].cpu().view(s.shape).clone()
    return out


def write(engine, d: str, client_state: dict, aliases: dict, exclude_frozen: bool = False) -> None:
    """Every rank: DeepSpeed's files for this rank into folder d (a collective: all-gathers); exclude_frozen:
    the module's frozen parameters left out of "module" and no frozen shapes or fragments written, as
    DeepSpeed's save_checkpoint(exclude_frozen_parameters) (runtime/engine.py: save_frozen_param)."""
    c, n, r, stage = engine.comm, engine.comm.size, engine.comm.rank, engine.stage_id
    _, tp = engine_mp(engine)                    # no pipeline here
    full = _full_values(engine)
    # DeepSpeed drops param groups without parameters (runtime/engine.py::_configure_optimizer), and its
    # zero_to_fp32 cannot read an empty one: the files hold the non-empty groups only, renumbered
    keep = nonempty_groups(engine)
    names = [engine.group_names[g] for g in keep]
    trained = set(engine.params_by_name)
    frozen = {k: p.detach().float().cpu() for k, p in engine.module.named_parameters()
              if k not in trained and k not in aliases}
    sd = engine.module.state_dict()
    for k, p in (engine.module.named_parameters() if exclude_frozen else ()):
        if not p.requires_grad:
            sd.pop(k, None)
    if stage == 3:   # DeepSpeed partitions every parameter, persistent too, before it saves (stage3.py
        # checkpoint_event_prologue): its "module" holds size-0 placeholders, as its load_state_dict expects
        sd.update((k, sd[k].new_empty(0)) for k, _ in engine.module.named_parameters(remove_duplicate=False) if k in sd)
    model = {"module": sd, "buffer_names": [k for k, _ in engine.module.named_buffers()], "optimizer": None,
             "param_shapes": [OrderedDict((k, engine.params_by_name[k].shape if stage != 3 else full[k]["master"].shape)
                                          for k in g) for g in names],
             "frozen_param_shapes": None if exclude_frozen else OrderedDict((k, v.shape) for k, v in frozen.items()),
             "shared_params": dict(aliases),
             "frozen_param_fragments": None if exclude_frozen else {k: (ds_partition(v, n, r) if stage == 3 else v)
                                                                    for k, v in frozen.items()},
             "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
             "data_sampler": None, "random_ltd": None, "skipped_steps": engine.skipped_steps,
             "global_steps": engine.global_steps, "global_samples": engine.global_samples,
             "dp_world_size": n, "mp_world_size": tp, "ds_config": engine.config.raw, "ds_version": DS_VERSION,
             "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": tp}, **client_state}
    if stage == 3 or r == 0:
        fname = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        atomic_write(os.path.join(d, fname), lambda f: torch.save(model, f))
    if stage == 0:
        return
    opt = engine.optimizer
    scaler = ({"cur_scale": engine.loss_scaler.cur_scale, "dynamic": True} if engine.loss_scaler.dynamic
              else _DeepSpeedLossScaler(engine.loss_scaler.cur_scale))
    # torch's format for DeepSpeed's base optimizer: one "parameter" per group (its flat fp32 partition)
    hyper = [{**{k: v for k, v in opt.param_groups[g].items() if k != "params"}, "params": [i]}
             for i, g in enumerate(keep)]
    flat = {k: [] for k in ("master", *opt.STATE)}
    maps = []                                  # (param_slice_mappings, group_paddings) per group
    for g in names:
        for k in flat:
            if stage == 3:
                parts = [ds_partition(full[x][k], n, r) for x in g]
                flat[k].append(torch.cat(parts) if parts else torch.zeros(0))
            else:
                v = torch.cat([full[x][k].reshape(-1) for x in g]) if g else torch.zeros(0)
                size = math.ceil(max(v.numel(), 1) / (2 * n)) * 2 * n
                if k == "master":     # per-rank padding, fragments (ds_to_universal), fp32 unpadded: DeepSpeed's
                    maps.append(slice_mappings(g, [full[x][k].numel() for x in g], n, r, size))
                v = torch.cat([v, v.new_zeros(size - v.numel())])
                flat[k].append(v.view(n, -1)[r][:size // n - (maps[-1][1] if k == "master" else 0)].clone())
    states = {i: {"step": torch.tensor(float(opt.state[g]["step"])), **{k: flat[k][i] for k in opt.STATE}}
              for i, g in enumerate(keep)}
    base = {"state": states, "param_groups": hyper}
    osd = {"zero_stage": stage, "loss_scaler": scaler, "dynamic_loss_scale": engine.loss_scaler.dynamic,
           "overflow": bool(opt.overflow), "partition_count": n if stage == 3 else [n] * len(names),
           "ds_version": DS_VERSION}
    if stage == 3:
        osd.update(optimizer_state_dict=base, fp32_flat_groups=flat["master"])
    else:
        osd.update(base_optimizer_state=base, single_partition_of_fp32_groups=flat["master"], group_paddings=[p for _, p in maps],
                   param_alignment_paddings=[[0] * len(g) for g in names], clip_grad=engine.config.gradient_clipping,
                   param_slice_mappings=[m for m, _ in maps])
    blob = {"optimizer_state_dict": osd, "ds_config": engine.config.raw, "ds_version": DS_VERSION}
    bf16 = "bf16_" if engine.bfloat16_enabled() else ""   # runtime/engine.py _get_zero_ckpt_prefix (see above)
    atomic_write(os.path.join(d, f"{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
                 lambda f: torch.save(blob, f, pickle_module=DS_PICKLE))


class _DeepSpeedLossScaler:
    """Pickled as DeepSpeed's static LossScaler (runtime/fp16/loss_scaler.py) without importing DeepSpeed:
    its engine's load_checkpoint takes the object as its loss scaler (cur_scale, dynamic=False)."""
    _deepspeed_name = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")

    def __init__(self, scale: float):
        self.cur_scale, self.dynamic = float(scale), False


def nonempty_groups(engine) -> list[int]:
    """The indices of the optimizer's param groups that hold a parameter (DeepSpeed keeps only these)."""
    return [g for g, ns in enumerate(engine.group_names) if ns]


# ----------------------------------------------------------------------------- reading
def is_deepspeed(load_dir: str, tag) -> bool:
    """A folder with DeepSpeed's files and no manifest of ours (ours also holds DeepSpeed's files)."""
    try:
        d = tag_folder(load_dir, tag)
    except CheckpointError:
        return False
    return (os.path.isdir(d) and not glob.glob(os.path.join(d, "*manifest.json"))
            and bool(glob.glob(os.path.join(d, "*_model_states.pt"))))


def rank_of(path: str) -> int:
    return int(os.path.basename(path).split("zero_pp_rank_")[1].split("_")[0])


def read_full(d: str, files: list | None = None) -> tuple[dict, dict, list]:
    """({name: {"param", "master", state keys}}, rank 0's model-states dict, the optimizer files); `files`: the
    optimizer files to read (default: every *_optim_states.pt in d)."""
    files = glob.glob(os.path.join(d, "*_optim_states.pt")) if files is None else files
    optim = [load_file(f)["optimizer_state_dict"] for f in sorted(files, key=rank_of)]
    models = sorted(glob.glob(os.path.join(d, "*_model_states.pt")))
    model = load_file(models[0])
    if not optim:
        raise CheckpointError(f"{d} has no *_optim_states.pt: a DeepSpeed ZeRO-0 checkpoint keeps its optimizer in "
                              "the model file, which is not read here; load it with DeepSpeed, or save at stage 1-3")
    stage, n = int(optim[0]["zero_stage"]), len(optim)
    full: dict = {}
    if stage <= 2:
        for g, shapes in enumerate(model["param_shapes"]):
            vecs = {"master": torch.cat([o["single_partition_of_fp32_groups"][g] for o in optim])}
            for k, v in optim[0]["base_optimizer_state"]["state"].get(g, {}).items():
                if k != "step":
                    vecs[k] = torch.cat([o["base_optimizer_state"]["state"][g][k] for o in optim])
            pads = (optim[0].get("param_alignment_paddings") or [[0] * len(shapes)])[g]
            off = 0
            for (name, shape), pad in zip(shapes.items(), pads):
                k_ = math.prod(shape)
                full[name] = {k: v[off:off + k_].view(shape) for k, v in vecs.items()}
                off += k_ + pad
    else:
        shapes = OrderedDict((k, v) for s in model["param_shapes"] for k, v in s.items())
        per_rank = [{"master": torch.cat(list(o["fp32_flat_groups"]))} for o in optim]
        for o, pr in zip(optim, per_rank):
            st = o["optimizer_state_dict"]["state"]
            for k in (st[0] if st else {}):
                if k != "step":
                    pr[k] = torch.cat([st[i][k] for i in range(len(st))])   # a dict 0..G-1 or a list
        off = 0
        for name, shape in shapes.items():
            k_, p = math.prod(shape), math.ceil(math.prod(shape) / n)
            full[name] = {k: torch.cat([pr[k][off:off + p] for pr in per_rank])[:k_].view(shape) for k in per_rank[0]}
            off += p
    for v in full.values():
        v["param"] = v["master"]
        for k in v:     # DeepSpeed saves its fp32 partitions as Parameters: the values only, no autograd
            v[k] = v[k].detach()
    return full, model, optim


def frozen_params(d: str, model: dict, optim: list) -> dict:
    """{name: full tensor} of the frozen parameters; at stage 3 every rank's model file holds its partition."""
    shapes = model.get("frozen_param_shapes") or {}
    files = sorted(glob.glob(os.path.join(d, "zero_pp_rank_*_mp_rank_00_model_states.pt")), key=rank_of)
    z3 = int(optim[0]["zero_stage"]) == 3 and len(files) == len(optim)
    frags = [load_file(f)["frozen_param_fragments"] for f in files] if z3 and shapes else None
    return {name: (torch.cat([f[name] for f in frags])[:math.prod(shape)] if z3
                   else model["frozen_param_fragments"][name]).reshape(shape) for name, shape in shapes.items()}


def load(engine, load_dir: str, tag, load_optimizer_states: bool, load_lr_scheduler_states: bool):
    d = tag_folder(load_dir, tag)
    full, model, optim = read_full(d)
    missing = sorted(set(engine.params_by_name) - set(full))
    if missing:
        raise CheckpointError(f"rank {engine.comm.global_rank}: DeepSpeed checkpoint {d} lacks parameters {missing[:4]}")
    st0 = optim[0].get("base_optimizer_state", optim[0].get("optimizer_state_dict", {}))
    steps = [int(s["step"]) for _, s in sorted(st0.get("state", {}).items())] or [0]
    hyper = [loaded_hyper(engine, h) for h in st0.get("param_groups", [])]
    keep = nonempty_groups(engine)
    if len(hyper) == len(keep) != len(engine.optimizer.param_groups):   # written without our empty groups
        at = {g: i for i, g in enumerate(keep)}
        steps = [steps[min(at.get(g, 0), len(steps) - 1)] for g in range(len(engine.optimizer.param_groups))]
        hyper = [hyper[at[g]] if g in at else {} for g in range(len(engine.optimizer.param_groups))]
    if len(hyper) != len(engine.optimizer.param_groups):
        hyper = [{} for _ in engine.optimizer.param_groups]        # grouped differently: keep ours
    scaler = optim[0].get("loss_scaler")
    cur = scaler["cur_scale"] if isinstance(scaler, dict) else getattr(scaler, "cur_scale", 1.0)
    man = {"optimizer": {"hyper": hyper, "steps": [steps[min(g, len(steps) - 1)] for g in range(len(hyper))]},
           "scheduler": model.get("lr_scheduler"), "global_steps": model["global_steps"],
           "micro_steps": model["global_steps"] * engine.config.gradient_accumulation_steps,
           "skipped_steps": model.get("skipped_steps", 0), "global_samples": model.get("global_samples"),
           "loss_scaler": {"cur_scale": cur}}
    extras = {k: v for k, v in model["module"].items() if k in set(model.get("buffer_names", []))}
    extras.update(frozen_params(d, model, optim))
    apply_full(engine, full, man, extras, load_optimizer_states, load_lr_scheduler_states, bit16_master(engine, load_optimizer_states))
    engine.stage.zero_grad()
    return d, {k: v for k, v in model.items() if k not in DS_KEYS}
