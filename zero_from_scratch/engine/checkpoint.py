"""Sharded checkpoints: one file per rank plus a manifest (and DeepSpeed's files: checkpoint_ds.py).

    engine.save_checkpoint("ckpt")                 # ckpt/global_step10 -> global_step10.<id>/{zero_rank000.pt, …, manifest.json}
    engine.load_checkpoint("ckpt")                 # same N: bit-exact resume
    engine.load_checkpoint("ckpt", reshard=True)   # different N or stage: re-partitioned from the manifest
    "checkpoint": {"load_universal": true}         # load_checkpoint reads DeepSpeed's universal folder instead
    python -m zero_from_scratch.engine.zero_to_fp32 ckpt out.pt    # one full fp32 state_dict

Each rank writes its local shards (params, the fp32 master in mixed precision, the optimizer's
state) and its RNG state; rank 0 writes manifest.json: the layout (every unit's parameters with
offsets, shapes, padding, N), counters, optimizer hyper-parameters, scheduler and loss-scaler
state, each shard file's byte size and a save id shared by every file of one save.
A save never destroys the previous good checkpoint, re-saving the same tag included. The phases
(PHASES; RINGZERO_CKPT_KILL_AT=phase[:rank] SIGKILLs a rank there, for the fault tests):
  validated  every argument checked on every rank and agreed by one small all-gather: a bad tag or
             a non-JSON client_state on any rank is a CheckpointError on every rank, before any write
  shard      each rank writes its file into a NEW folder <tag>.<save id> (temp name, fsync, rename)
  manifest   rank 0 writes manifest.json there, last: a folder with a manifest is complete
  tag        rank 0 points the symlink <tag> at the new folder (one rename(2): atomic)
  latest     rank 0 rewrites `latest` (the tag, as DeepSpeed writes it) the same way
  cleanup    rank 0 removes the folder <tag> pointed at before, and leftovers of killed saves
Loading checks a different model (names/shapes), a different layout without reshard=True, missing
or truncated shard files and files from different saves: each a CheckpointError. Under the runner
(engine.ds_dp_change) a save at another N and the same ZeRO stage (1-3) loads as DeepSpeed's engine loads it
(runtime/engine.py::_load_zero_checkpoint): with optimizer states its ZeRORuntimeException, without
them the weights, the fp32 master set from them (bit16_master: DeepSpeed's engine reads no ZeRO file then).
With an mpu each model-parallel rank is its own ZeRO world, its files prefixed like DeepSpeed's
mp_rank_XX (mp_rank_01_zero_rank000.pt, mp_rank_01_manifest.json); the save id is agreed over the
model-parallel group too and every manifest is written before the one publish (global rank 0);
consolidate(mp_rank=) gives one model-parallel rank's state dict.
Loading goes through full tensors (unshard, then shard with the current layout): at the same N pure
copying, hence bit-exact, and the same code reshards. Cost: each rank reads every shard file once
(O(Ψ) memory transiently); a save adds two 24-byte-per-rank all-gathers and one 8-byte barrier.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import warnings

import torch

from zero_from_scratch.engine.atomic import atomic_symlink, atomic_write
from zero_from_scratch.engine.checkpoint_read import (FORMAT, CheckpointError, _manifest_file, _shard_file, apply_full,
                                                      bit16_master, no_latest, read_manifest, read_shards, unshard)
from zero_from_scratch.engine.client_optim import ZeRORuntimeException
from zero_from_scratch.engine.mpu import engine_mp
from zero_from_scratch.engine import checkpoint_ds, checkpoint_universal, z3_ds_tensor
import random

PHASES = ("validated", "shard", "manifest", "tag", "latest", "cleanup")
KILL_ENV = "RINGZERO_CKPT_KILL_AT"


def _phase(name: str, rank: int) -> None:
    """Fault injection: SIGKILL this process at phase `name` when RINGZERO_CKPT_KILL_AT asks."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    phase, _, who = want.partition(":")
    if phase == name and (who == "" or int(who) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def _local_params(engine) -> list[torch.Tensor]:
    out = []
    for g in range(len(engine.layout.group_local)):
        parts = [z3_ds_tensor.master_of(engine, u) for u in engine.layout.units_of_group(g)]   # fp32: not a ds_tensor write
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=engine.dtype))
    return out


def _model_spec(engine) -> list:
    return [[n, list(engine.params_by_name[n].shape) if engine.stage_id != 3 else list(engine.layout.where[n][1].shape), g]
            for g, ns in enumerate(engine.group_names) for n in ns]


_PROBLEMS = {1: "save_dir is not a folder that can be created or written",
             2: "tag is not a usable folder name (non-empty, no '/', not 'latest', not starting with '.')",
             3: "client_state is not a JSON-serialisable dict"}


def _check_args(save_dir, tag: str, client_state) -> tuple[int, str]:
    """(problem code, detail) for this rank's arguments; (0, "") when they are fine."""
    if not isinstance(tag, str) or not tag or os.sep in tag or tag == "latest" or tag.startswith("."):
        return 2, f"tag {tag!r}"
    if not isinstance(client_state, dict):
        return 3, f"client_state is a {type(client_state).__name__}"
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as e:
        return 3, f"json.dumps(client_state): {e}"
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as e:
        return 1, f"{save_dir!r}: {e}"
    if not os.access(save_dir, os.W_OK):
        return 1, f"{save_dir!r} is not writable"
    return 0, ""


def _agree(c, save_dir, tag, client_state, mode=None) -> tuple[int, str]:
    """Validate on every rank, then one all-gather so every rank raises the same error (naming the
    ranks and what is wrong) instead of one rank failing and the others waiting at a collective.
    Returns the save id, drawn on rank 0, and the tag (rank 0's: _rank0_tag)."""
    code, detail = _check_args(save_dir, tag, client_state)
    tag_hash = int.from_bytes(hashlib.sha1(str(tag).encode()).digest()[:7], "little")
    sid = int.from_bytes(os.urandom(6), "little") if c.rank == 0 else 0
    rows = c.gather_ints([code, tag_hash, sid], "checkpoint") if c.size > 1 else [[code, tag_hash, sid]]
    bad = [(r, row[0]) for r, row in enumerate(rows) if row[0]]
    if bad:
        who = "; ".join(f"rank {r}: {_PROBLEMS[k]}" for r, k in bad)
        mine = f" (here, rank {c.rank}: {detail})" if code else ""
        raise CheckpointError(f"save_checkpoint refused on every rank, nothing written: {who}{mine}")
    if len({row[1] for row in rows}) > 1:
        return rows[0][2], _rank0_tag(c, tag, mode)
    return rows[0][2], tag


def _rank0_tag(c, tag: str, mode: str | None) -> str:
    """Ranks passed different tags. checkpoint.tag_validation unset (ringzero's own): refused. FAIL:
    DeepSpeed's assertion (runtime/engine.py::_checkpoint_tag_validation). WARN / IGNORE: DeepSpeed
    writes each rank's files under its own tag (a checkpoint no load can use); here all are written
    under rank 0's tag, which `latest` names, with DeepSpeed's warning and where the files went."""
    msg = (f"[rank={c.rank}] The checkpoint tag name '{tag}' is not consistent across all ranks. Including rank "
           "unique information in checkpoint tag could cause issues when restoring with different world sizes.")
    if mode is None:
        raise CheckpointError(f"save_checkpoint refused on every rank, nothing written: the ranks passed different "
                              f"tags (rank {c.rank} has {tag!r}); pass the same tag everywhere")
    assert mode != "FAIL", msg
    raw = torch.tensor(list(tag.encode()) + [0] * 256, dtype=torch.uint8)[:256]   # rank 0's tag, ≤ 255 bytes
    c.broadcast(raw, 0, purpose="checkpoint")
    first = bytes(raw.tolist()).rstrip(b"\0").decode()
    warnings.warn(f"{msg} ringzero writes every rank's files under rank 0's tag {first!r}", stacklevel=3)
    return first


def _agree_mp(engine, sid: int, tag, refused: CheckpointError | None) -> int:
    """Model parallelism: each dp group agreed on its own; now the mp group shares mp rank 0's
    save id (one folder for the whole save), checks the tags match, and a refusal in any dp
    group is a refusal on every rank (the others would wait for it at the next collective)."""
    m = engine.mp
    tag_hash = int.from_bytes(hashlib.sha1(str(tag).encode()).digest()[:7], "little")
    rows = m.gather_ints([tag_hash, sid, 1 if refused else 0], "checkpoint")
    if refused is not None:
        raise refused
    if any(row[2] for row in rows):
        bad = [r for r, row in enumerate(rows) if row[2]]
        raise CheckpointError(f"save_checkpoint refused on every rank, nothing written: model-parallel ranks {bad} "
                              f"refused their arguments (their error names the problem); global rank "
                              f"{m.global_rank} stops too")
    if len({row[0] for row in rows}) > 1:
        raise CheckpointError(f"save_checkpoint refused, nothing written: the model-parallel ranks passed different "
                              f"tags (global rank {m.global_rank} has {tag!r}); pass the same tag everywhere")
    m.usage.pop("checkpoint", None)
    return rows[0][1]


def save(engine, save_dir: str, tag, client_state: dict, exclude_frozen: bool = False) -> str:
    c = engine.comm
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    mp_rank, mp_size = engine_mp(engine)
    if not save_dir:      # DeepSpeed's check, before any collective (runtime/engine.py::save_checkpoint)
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    try:
        sid, tag = _agree(c, save_dir, tag, client_state, getattr(engine.config, "tag_validation", None))
    except CheckpointError as e:
        if mp_size == 1:
            raise
        _agree_mp(engine, 0, tag, e)
    if mp_size > 1:
        sid = _agree_mp(engine, sid, tag, None)
    _phase("validated", c.rank)
    folder = f"{tag}.{sid:012x}"
    d = os.path.join(save_dir, folder)
    os.makedirs(d, exist_ok=True)
    params = _local_params(engine)
    local = [{"param": params[g], "master": engine.master[g] if engine.mixed else None,
              **{k: s[k] for k in engine.optimizer.STATE}} for g, s in enumerate(engine.optimizer.state)]
    sharded = set(engine.params_by_name)
    canon = {id(q): k for k, q in engine.params_by_name.items()}      # shared parameters: every other name
    aliases = {n: canon[id(p)] for n, p in engine.module.named_parameters(remove_duplicate=False)
               if canon.get(id(p), n) != n}
    extras = {k: v.clone() for k, v in engine.module.state_dict().items() if k not in sharded and k not in aliases}
    blob = {"format": FORMAT, "save_id": sid, "rank": c.rank, "local": local, "rng": engine.rng_state(),
            "extras": extras if c.rank == 0 else None}
    size = atomic_write(os.path.join(d, _shard_file(c.rank, mp_rank, mp_size)), lambda f: torch.save(blob, f))
    _phase("shard", c.rank)
    if mp_size == 1:                             # DeepSpeed's files too: its zero_to_fp32 reads this folder
        checkpoint_ds.write(engine, d, client_state, aliases, exclude_frozen)
    sizes = c.gather_ints([size], "checkpoint") if c.size > 1 else [[size]]
    if c.rank == 0:
        man = {"format": FORMAT, "save_id": sid, "tag": tag, "world_size": c.size, "stage": engine.stage_id,
               "dtype": str(engine.dtype), "layout": engine.layout.to_manifest(), "params": _model_spec(engine),
               "aliases": aliases, "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
               "global_samples": engine.global_samples,
               "skipped_steps": engine.skipped_steps,
               "optimizer": {"hyper": engine.optimizer.hyper_state(), "steps": [s["step"] for s in engine.optimizer.state]},
               "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
               "loss_scaler": engine.loss_scaler.state_dict(), "client_state": client_state,
               "mp_rank": mp_rank, "mp_world_size": mp_size,
               "shard_files": {str(r): {"file": _shard_file(r, mp_rank, mp_size), "bytes": sizes[r][0]}
                               for r in range(c.size)}}
        atomic_write(os.path.join(d, _manifest_file(mp_rank, mp_size)),
                     lambda f: f.write(json.dumps(man, indent=1).encode()))
        if mp_size > 1:                          # every mp rank's manifest is in before the publish
            engine.mp.gather_ints([0], "checkpoint")
        if mp_rank == 0:
            _publish(save_dir, tag, folder)
        if mp_size > 1:                          # and nobody returns before it
            engine.mp.gather_ints([0], "checkpoint")
            engine.mp.usage.pop("checkpoint", None)
    if c.size > 1:
        c.gather_ints([0], "checkpoint")         # barrier: nobody loads before the manifest exists
    c.usage.pop("checkpoint", None)
    if hasattr(engine.stage, "gather_persistent"):
        engine.stage.gather_persistent()
    return os.path.join(save_dir, tag)


def _is_version_of(name: str, tag: str) -> bool:
    """True for the folders one tag's saves create: <tag>.<12 hex digits> and <tag>.old."""
    rest = name[len(tag) + 1:] if name.startswith(f"{tag}.") else None
    return rest == "old" or (rest is not None and len(rest) == 12 and all(ch in "0123456789abcdef" for ch in rest))


def _publish(save_dir: str, tag: str, folder: str) -> None:
    """Rank 0, after the new folder is complete: swap the tag's symlink, then `latest`, then clean up."""
    _phase("manifest", 0)
    link = os.path.join(save_dir, tag)
    if os.path.isdir(link) and not os.path.islink(link):   # a real folder (older format): move it aside
        os.replace(link, os.path.join(save_dir, f"{tag}.old"))
    atomic_symlink(folder, link)
    _phase("tag", 0)
    atomic_write(os.path.join(save_dir, "latest"), lambda f: f.write(tag.encode()))
    _phase("latest", 0)
    for name in os.listdir(save_dir):                      # the folder replaced, and killed saves' leftovers
        path = os.path.join(save_dir, name)
        if name != folder and _is_version_of(name, tag) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
    _phase("cleanup", 0)


def _check_model(engine, man: dict) -> None:
    mine, theirs = _model_spec(engine), man["params"]
    if [m[:2] for m in mine] != [t[:2] for t in theirs]:
        a, b = {m[0]: m[1] for m in mine}, {t[0]: t[1] for t in theirs}
        diff = ([f"{k}: missing in checkpoint" for k in a if k not in b] + [f"{k}: not in this model" for k in b if k not in a]
                + [f"{k}: shape {b[k]} in checkpoint vs {a[k]} here" for k in a if k in b and a[k] != b[k]])
        raise CheckpointError("checkpoint is from a different model: " + ("; ".join(diff[:4]) or "parameter order differs"))


def load(engine, load_dir, tag, load_optimizer_states=True, load_lr_scheduler_states=True, reshard=False):
    if checkpoint_universal.wanted(engine):           # "checkpoint": {"load_universal": true}, DeepSpeed's folder
        return checkpoint_universal.load(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
    if no_latest(load_dir, tag):
        return None, None
    if checkpoint_ds.is_deepspeed(load_dir, tag):     # DeepSpeed's own layout (checkpoint_ds.py)
        return checkpoint_ds.load(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
    c = engine.comm
    d, man = read_manifest(load_dir, tag, *engine_mp(engine))
    _check_model(engine, man)
    if getattr(engine, "ds_dp_change", False) and man["stage"] == engine.stage_id > 0 and man["world_size"] != c.size:
        if load_optimizer_states:                     # DeepSpeed's words
            raise ZeRORuntimeException(
                f"The checkpoint being loaded used a DP world size of {man['world_size']} but the current world size "
                f"is {c.size}. Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is "
                "not currently supported.")
        reshard = True
    if man["layout"] != engine.layout.to_manifest() and not reshard:
        raise CheckpointError(
            f"rank {c.rank}: checkpoint {d} was saved with N={man['world_size']} ranks at ZeRO stage {man['stage']}; "
            f"this run has N={c.size} at stage {engine.stage_id}, so the shards do not line up. Pass "
            "load_checkpoint(..., reshard=True) to re-partition from the manifest (optimizer state included)")
    shards = read_shards(d, man)
    apply_full(engine, unshard(man, shards), man, shards[0].get("extras"), load_optimizer_states,
               load_lr_scheduler_states, master_from_param=bit16_master(engine, load_optimizer_states))
    if man["world_size"] == c.size:                   # same ranks: same random streams
        own = shards[c.rank] if c.rank < len(shards) else torch.load(
            os.path.join(d, man["shard_files"][str(c.rank)]["file"]), map_location="cpu", weights_only=False)
        torch.set_rng_state(own["rng"]["torch"])
        random.setstate(own["rng"]["python"])
    engine.stage.zero_grad()
    return d, man.get("client_state", {})
