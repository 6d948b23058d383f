"""ZeRO over a data-parallel subgroup: DeepSpeed's `mpu` (model-parallel unit) protocol.

    mesh = primitives.mesh.Mesh.build(dp=2, tp=2)
    parallelize(model, mesh.tp_group)
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg, mpu=mesh.mpu())

An mpu answers six questions (deepspeed.initialize(mpu=...) asks the same ones, Megatron's
parallel_state answers them): get_data_parallel_group / _rank / _world_size and
get_model_parallel_group / _rank / _world_size. With one, every ZeRO collective (the gradient
reduce-scatters, the parameter all-gathers, the init broadcast, checkpoint agreement) runs over
the data-parallel group: each model-parallel rank is its own ZeRO world of its own local
(sharded) parameters. Two things still cross the model-parallel group, as in DeepSpeed:
  * the global gradient norm: Σ over dp of the local shard norms², then Σ over mp, with
    replicated parameters (not tensor-parallel) counted on mp rank 0 only (`counts_on`);
  * checkpoints: files carry mp_rank_XX, one manifest per mp rank, one publish for the save.
checkpoint_parallel_metadata(mpu) is DeepSpeed's record of the degrees in a checkpoint (the runner's
deepspeed.runtime.engine._checkpoint_parallel_metadata).
Cost at start-up: one all-gather of 6 int64 per rank over the world (`check`), so an mpu whose
groups do not factor the world is the same clear error on every rank. Per step: one extra
8-byte all-reduce over the mp group (the norm).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import primitives as P
from zero_from_scratch import clip

METHODS = ("get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size")


class MPUError(ValueError):
    """An mpu that does not describe a data × model-parallel factoring of the world."""


@dataclass
class Parallel:
    dp_group: object
    mp_group: object
    dp_rank: int
    dp_size: int
    mp_rank: int
    mp_size: int


def is_model_parallel(p: torch.Tensor) -> bool:
    """True for a parameter each model-parallel rank holds a different slice of: ours
    (tensor_parallel.layers sets tp_shard) or Megatron/DeepSpeed's markers."""
    return (getattr(p, "tp_shard", None) is not None or bool(getattr(p, "model_parallel", False))
            or bool(getattr(p, "tensor_model_parallel", False)))


def counts_on(p: torch.Tensor, mp_rank: int) -> bool:
    """Does p's gradient enter the global norm on this model-parallel rank? Sharded parameters
    on every rank (their slices add up to the whole), replicated ones on mp rank 0 only, so one
    Σ over the mp group counts each element once (DeepSpeed's rule)."""
    return mp_rank == 0 or is_model_parallel(p)


def mp_prefix(mp_rank: int, mp_size: int) -> str:
    """What a per-rank file name starts with, so model-parallel ranks never share one (DeepSpeed's
    mp_rank_XX); empty without model parallelism, so those names stay as they were."""
    return f"mp_rank_{mp_rank:02d}_" if mp_size > 1 else ""


def checkpoint_parallel_metadata(mpu) -> dict:
    """DeepSpeed's `_checkpoint_parallel_metadata(mpu)` (runtime/engine.py; utils/bwc.py's queries, in its
    order): the pipeline and tensor-parallel degrees a checkpoint records; 1 and 1 without an mpu."""
    pp = tp = 1
    if mpu is not None:
        pp = next((getattr(mpu, m)() for m in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
                   if hasattr(mpu, m)), 1)
        tp = next((getattr(mpu, m)() for m in ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size")
                   if hasattr(mpu, m)), None)
        tp = mpu.get_model_parallel_world_size() if tp is None else tp
    return {"checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp}}


def engine_mp(engine) -> tuple[int, int]:
    """(model-parallel rank, size) of a ZeroEngine; (0, 1) without an mpu."""
    return (engine.mp.rank, engine.mp.size) if getattr(engine, "mp", None) is not None else (0, 1)


def _members(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def check(mpu) -> Parallel:
    """The mpu's groups, verified on every rank against every other rank's answers."""
    me, world = dist.get_rank(), dist.get_world_size()
    problem = ""
    try:
        missing = [m for m in METHODS if not callable(getattr(mpu, m, None))]
        if missing:
            raise MPUError(f"mpu {type(mpu).__name__} lacks {missing}")
        dpg, mpg = mpu.get_data_parallel_group(), mpu.get_model_parallel_group()
        got = [int(mpu.get_data_parallel_rank()), int(mpu.get_data_parallel_world_size()),
               int(mpu.get_model_parallel_rank()), int(mpu.get_model_parallel_world_size())]
        dpm, mpm = _members(dpg), _members(mpg)
        if len(dpm) != got[1] or dpm.index(me) != got[0]:
            raise MPUError(f"get_data_parallel_rank/world_size say {got[0]} of {got[1]} but the group holds ranks {dpm}")
        if len(mpm) != got[3] or mpm.index(me) != got[2]:
            raise MPUError(f"get_model_parallel_rank/world_size say {got[2]} of {got[3]} but the group holds ranks {mpm}")
        if set(dpm) & set(mpm) != {me}:
            raise MPUError(f"the data-parallel group {dpm} and model-parallel group {mpm} must share only this rank")
    except (MPUError, ValueError, RuntimeError) as e:
        problem, got, dpg, mpg = str(e), [-1, -1, -1, -1], None, None
    mine = torch.tensor([*got, 1 if problem else 0, me], dtype=torch.int64)
    rows = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    rows = [r.tolist() for r in rows]
    bad = [r[5] for r in rows if r[4]]
    pairs = {(r[0], r[2]) for r in rows}
    sizes = {(r[1], r[3]) for r in rows}
    why = (f"ranks {bad} could not read their groups" if bad else
           f"ranks disagree on (dp, mp) sizes: {sorted(sizes)}" if len(sizes) > 1 else
           f"dp={rows[0][1]} × mp={rows[0][3]} = {rows[0][1] * rows[0][3]} does not factor the world size {world}"
           if rows[0][1] * rows[0][3] != world else
           "two ranks have the same (dp rank, mp rank)" if len(pairs) != world else "")
    if why:
        raise MPUError(f"rank {me}: initialize(mpu=...): {why}" + (f" (here: {problem})" if problem else "")
                       + "; an mpu must split the world into data-parallel × model-parallel groups "
                       "(primitives.mesh.Mesh.build(dp=, tp=).mpu() does)")
    return Parallel(dpg, mpg, *got)


def counted_ranges(engine, mp_rank: int) -> list[list[tuple[int, int]]]:
    """Per unit: the [a, b) slices of this rank's shard whose squares enter the global norm.
    Model-parallel parameters always count (each mp rank holds other elements); replicated ones
    only on mp rank 0, so the Σ over the mp group counts them once (DeepSpeed's rule)."""
    out = []
    for u in engine.layout.units:
        lo, hi = u.shard_range(engine.stage.owner())
        keep: list[tuple[int, int]] = []
        for s in u.slots:
            if not counts_on(engine.params_by_name[s.name], mp_rank):
                continue
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                if keep and keep[-1][1] == a - lo:
                    keep[-1] = (keep[-1][0], b - lo)
                else:
                    keep.append((a - lo, b - lo))
        out.append(keep)
    return out


def clip_grad_norm_(params, max_norm: float, mp_group, mp_rank: int) -> float:
    """clip.clip_grad_norm_ for a model-parallel model whose gradients are already averaged over
    dp (DDP): the norm sums over the mp group, replicated parameters counted on mp rank 0 only."""
    return clip.clip_grad_norm_(params, max_norm, P.get_comm(mp_group), lambda p: counts_on(p, mp_rank))
