"""Reading a ZeRO checkpoint: the file names, the manifest, the shards, and one full state_dict.

    python -m zero_from_scratch.engine.zero_to_fp32 CKPT_DIR OUT.pt

The format checkpoint.py writes (FORMAT): per rank one shard file (param, fp32 master, Adam's m
and v over the rank's local buffer), per model-parallel rank one manifest (the layout of
sharding.py and every parameter's name and shape). `unshard` rebuilds every full tensor from
all ranks' shards, so a checkpoint loads at any world size, and `consolidate` is the
fp32 state_dict (zero_to_fp32). `tag_validation_mode` reads checkpoint.tag_validation as DeepSpeed
does (WARN / IGNORE / FAIL, else its DeepSpeedConfigError); checkpoint.py acts on it when ranks pass
different tags. Cost: every shard file is read once (O(Ψ) memory).
"""
from __future__ import annotations

import json
import math
import os
import warnings

import torch

from zero_from_scratch.engine.mpu import mp_prefix

FORMAT = "ringzero-zero/1"


class DeepSpeedConfigError(ValueError):
    """A config value DeepSpeed refuses with its DeepSpeedConfigError (runtime/config.py)."""


def tag_validation_mode(raw: dict) -> str | None:
    """DeepSpeed's get_checkpoint_tag_validation_mode: WARN / IGNORE / FAIL in any case, else its error."""
    mode = (raw.get("checkpoint") or {}).get("tag_validation")
    if mode is not None and str(mode).upper() not in ("WARN", "IGNORE", "FAIL"):
        raise DeepSpeedConfigError(f"Checkpoint config contains invalid tag_validation value of {str(mode).upper()}, "
                                   "expecting one of ['WARN', 'IGNORE', 'FAIL']")
    return None if mode is None else str(mode).upper()


class CheckpointError(RuntimeError):
    pass


def _shard_file(rank: int, mp_rank: int = 0, mp_size: int = 1) -> str:
    return f"{mp_prefix(mp_rank, mp_size)}zero_rank{rank:03d}.pt"


def _manifest_file(mp_rank: int = 0, mp_size: int = 1) -> str:
    return f"{mp_prefix(mp_rank, mp_size)}manifest.json"


def tag_folder(load_dir: str, tag=None) -> str:
    """The folder of `tag` (default: the one `latest` names); ours and DeepSpeed's."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.exists(latest):
            raise CheckpointError(f"no 'latest' file in {load_dir!r}: not a checkpoint directory, or pass tag=")
        tag = open(latest).read().strip()
    return os.path.join(load_dir, str(tag))


def no_latest(load_dir: str, tag) -> bool:
    """True (and DeepSpeed's warning) when tag is None and load_dir has no `latest`: load_checkpoint then
    loads nothing and returns (None, None), as DeepSpeed's does."""
    if tag is not None or os.path.isfile(os.path.join(load_dir, "latest")):
        return False
    warnings.warn(f"Unable to find latest file at {os.path.join(load_dir, 'latest')}, if trying to load latest "
                  "checkpoint please ensure this file exists or pass an explicit checkpoint tag when loading a "
                  "checkpoint. Nothing was loaded: load_checkpoint returns (None, None), as DeepSpeed's does",
                  stacklevel=4)
    return True


def read_manifest(load_dir: str, tag=None, mp_rank: int = 0, mp_size: int = 1) -> tuple[str, dict]:
    d = tag_folder(load_dir, tag)
    if not os.path.exists(d) and os.path.isdir(d + ".old"):   # killed while moving an old-format folder aside
        d += ".old"
    path = os.path.join(d, _manifest_file(mp_rank, mp_size))
    if not os.path.exists(path):
        others = sorted(f for f in os.listdir(d) if f.endswith("manifest.json")) if os.path.isdir(d) else []
        raise CheckpointError(f"checkpoint {d!r} has no {os.path.basename(path)} (model-parallel rank {mp_rank} of "
                              f"{mp_size}); it holds {others or 'no manifest'}: missing, from another tool, or saved "
                              "with another model-parallel size")
    try:
        man = json.load(open(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}): the file is damaged") from None
    if man.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {man.get('format')!r}, expected {FORMAT!r}")
    return d, man


def read_shards(d: str, man: dict) -> list[dict]:
    """The shard files the layout needs (ranks 0..layout N-1), each verified against the manifest."""
    out = []
    for r in range(man["layout"]["world_size"]):
        info = man["shard_files"][str(r)]
        path = os.path.join(d, info["file"])
        if not os.path.exists(path):
            raise CheckpointError(f"shard file {path} is missing (checkpoint saved by {man['world_size']} ranks)")
        got = os.path.getsize(path)
        if got != info["bytes"]:
            raise CheckpointError(f"shard file {path} has {got} bytes, the manifest says {info['bytes']}: "
                                  "truncated or overwritten")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"shard file {path} cannot be read ({type(e).__name__}): corrupt") from None
        if blob.get("save_id") != man["save_id"]:
            raise CheckpointError(f"shard file {path} belongs to a different save than manifest.json "
                                  "(an interrupted save over the same tag?)")
        out.append(blob)
    return out


def unshard(man: dict, shards: list[dict]) -> dict:
    """{param name: {key: full tensor}} from the per-rank local buffers, using the manifest's layout."""
    lay = man["layout"]
    full: dict[str, dict] = {}
    for u in lay["units"]:
        g, s, off = u["group"], u["shard"], u["local_offset"]
        for key in shards[0]["local"][g]:            # param, master and the optimizer's own state names
            if shards[0]["local"][g][key] is None:
                continue
            buf = torch.cat([sh["local"][g][key][off:off + s] for sh in shards])
            for name, shape, o in u["slots"]:
                full.setdefault(name, {})[key] = buf[o:o + math.prod(shape)].view(shape)
    return full


def consolidate(load_dir: str, tag=None, mp_rank: int = 0, mp_size: int = 1) -> dict:
    """One full fp32 state_dict (master weights when the run was mixed precision); with model
    parallelism, the state dict of model-parallel rank mp_rank of mp_size."""
    d, man = read_manifest(load_dir, tag, mp_rank, mp_size)
    shards = read_shards(d, man)
    full = unshard(man, shards)
    sd = {}
    for name, _shape, _g in man["params"]:
        t = full[name].get("master")
        sd[name] = (t if t is not None else full[name]["param"]).float().clone()
    for alias, canon in man["aliases"].items():
        sd[alias] = sd[canon]
    for k, v in (shards[0].get("extras") or {}).items():
        sd[k] = v
    return sd


def loaded_hyper(engine, h: dict) -> dict:
    """A saved param group's settings as DeepSpeed's loaders copy them: every key but the params
    (torch's load_state_dict; base_optimizer.py / stage3.py for a universal folder), so initial_lr
    and the like come back. ringzero's Adam reads lr, betas, eps, weight_decay; a setting that would
    change torch's update and that it has no form of is refused, naming it."""
    for k in ("amsgrad", "maximize"):
        if h.get(k):
            raise CheckpointError(f"rank {engine.comm.global_rank}: the checkpoint's param group has {k}=True, which "
                                  f"DeepSpeed's torch Adam would then follow; ringzero's Adam has no {k}")
    return {k: v for k, v in h.items() if k != "params"}


def bit16_master(engine, load_optimizer_states: bool) -> bool:
    """Under the runner (engine.ds_dp_change), a load without optimizer states sets a mixed-precision
    run's fp32 master from the loaded 16-bit weights, as DeepSpeed's engine does (it skips its ZeRO
    files then: runtime/engine.py load_checkpoint → optimizer._restore_from_bit16_weights)."""
    return getattr(engine, "ds_dp_change", False) and not load_optimizer_states


@torch.no_grad()     # the shards are written, not differentiated (a loaded tensor may require grad)
def apply_full(engine, full: dict, man: dict, extras, load_optimizer_states: bool, load_lr_scheduler_states: bool,
               master_from_param: bool = False):
    """Full tensors {name: {"param", "master", state keys}} → this rank's shards with the current
    layout; then the optimizer's hyper-parameters and steps, the scheduler, loss scaler, counters.
    master_from_param: a mixed-precision run's fp32 master is the loaded 16-bit weights upcast, not
    the saved master (DeepSpeed's engine without optimizer states: _restore_from_bit16_weights)."""
    lay, st, keys = engine.layout, engine.stage, ("param", "master", *engine.optimizer.STATE)
    for u in lay.units:
        lo, hi = u.shard_range(st.owner())
        bufs = {k: torch.zeros(u.padded, dtype=torch.float32 if k != "param" else engine.dtype) for k in keys}
        for s in u.slots:
            src = full[s.name]
            master = src.get("master")
            bufs["param"][s.offset:s.offset + s.numel].copy_(src["param"].reshape(-1))
            if engine.mixed:
                m = master if master is not None and not master_from_param else src["param"].float()
                bufs["master"][s.offset:s.offset + s.numel].copy_(m.reshape(-1))
            elif master is not None:                  # mixed checkpoint into an fp32 run: take the master
                bufs["param"][s.offset:s.offset + s.numel].copy_(master.reshape(-1))
            for k in engine.optimizer.STATE:
                if k not in src and load_optimizer_states:
                    raise CheckpointError(f"checkpoint has no optimizer state {k!r} for {s.name!r} ({engine.optimizer.name} "
                                          "needs it); pass load_optimizer_states=False to load the weights only")
                if k in src:
                    bufs[k][s.offset:s.offset + s.numel].copy_(src[k].reshape(-1))
        if engine.stage_id == 3:
            st.param_shard(u).copy_(bufs["param"][lo:hi])
        else:
            st.flat[u.group][u.flat_offset:u.flat_offset + u.padded].copy_(bufs["param"])
        sl = slice(u.local_offset, u.local_offset + u.shard)
        if engine.mixed:
            engine.master[u.group][sl].copy_(bufs["master"][lo:hi])
        if load_optimizer_states:
            for k in engine.optimizer.STATE:
                engine.optimizer.state[u.group][k][sl].copy_(bufs[k][lo:hi])
    if load_optimizer_states:
        engine.optimizer.shared_step = None      # loaded steps are the groups' own (checkpoint_universal.py)
        for g, (h, step) in enumerate(zip(man["optimizer"]["hyper"], man["optimizer"]["steps"])):
            engine.optimizer.param_groups[g].update({k: (tuple(v) if k == "betas" else v) for k, v in h.items()})
            engine.optimizer.state[g]["step"] = step
    if load_lr_scheduler_states and engine.lr_scheduler is not None and man["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(man["scheduler"])
    engine.loss_scaler.load_state_dict(man["loss_scaler"])
    applied = engine.was_step_applied() if hasattr(engine, "was_step_applied") else False
    engine.global_steps, engine.micro_steps = man["global_steps"], man["micro_steps"]
    samples = man.get("global_samples")              # DeepSpeed's count; a folder without it: steps × batch
    engine.global_samples = engine.global_steps * engine.config.train_batch_size if samples is None else samples
    engine.applied_at = engine.micro_steps - 1 if applied else None   # DeepSpeed's _step_applied: a load leaves it
    engine.skipped_steps = man["skipped_steps"]
    if extras:
        engine.module.load_state_dict(extras, strict=False)
