"""Expert parameters at ZeRO-0/1/2 with ep_size > 1: reduced over their expert-data-parallel group, as DeepSpeed 0.19.8.

    python -m pytest -q -m slow tests/test_moe.py -k training  (2 and 4 ranks, ep_size 1 and 2: against DeepSpeed)

With ep_size E > 1 each rank holds num_experts/E of the experts: rank r's expert parameters are the
same tensors as those of the other members of its expert-data-parallel group (M = N/E ranks, the
"ep_size_E" group of as_deepspeed/expert_groups.py) and differ from everyone else's. DeepSpeed
(engine.py _broadcast_model, _reduce_expert_gradients; stage_1_and_2.py average_tensor) starts them
from that group's first rank, sums their gradients over that group only and divides by the whole
world N, as dense gradients: the experts saw tokens from every rank of their expert-parallel group
through the all-to-all, so the sum over M ranks holds the contributions of all N ranks' losses.
Here, per expert group (engine.expert_comms: unit index → an engine Comm over that group; the
units are cut where the expert group changes, so a unit is all dense or all one group's experts):
  init       the values set before the engine's world broadcast are put back and broadcast from
             the group's first rank over the group (ExpertUnits._make_param_storage);
  reduce     each expert unit is all-reduced over its group (ExpertUnits._sum_into_block);
             the step's ÷N then applies to it as to every gradient;
  partition  ZeRO-1/2: the group's units are whole on every member (`WholeUnit`: each member steps the
             whole unit with the same summed gradient, so the members stay equal with no all-gather).
             DeepSpeed partitions them over the M members: the same updates, M× the optimizer-state
             memory for the experts here;
  norm       each member counts 1/M of a whole unit (norm_ranges), so the world's Σg² counts every
             expert element once, as DeepSpeed's (its per-group norm averaged over the group).
ZeRO-0 (stage0_norm): each rank's norm is local (every rank holds every gradient, no all-reduce); with expert
groups the ranks' norms differ. DeepSpeed's fp32 clip (runtime/utils.py clip_grad_norm_) uses their mean over
the world (one 4-byte all-reduce per step). In bf16/fp16 its FP16 optimizers decide: FP16_Optimizer (a FusedAdam)
adds to the dense norm each "moe" group's Σg² summed over its expert-parallel group (get_norm_with_moe_layers;
here one world all-reduce of Σg²/M, 8 bytes); FP16_UnfusedOptimizer (any other) clips by the norm of the
non-expert gradients alone, the expert ones only checked for overflow (under the runner, with or without MoE, in
its arithmetic: unfused_norm). Both take one more pass over the gradients.
Cost (Ψ_e: this rank's expert elements): their reduce sends 2(M-1)/M·Ψ_e per rank and step (an
all-reduce over M ranks), and no all-gather; their fp32 Adam state is 8Ψ_e bytes per rank, not 8Ψ_e/M.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from zero_from_scratch.clip import sum_of_squares
from zero_from_scratch.engine.moe_params import is_moe_param, is_moe_param_group
from zero_from_scratch.engine.optimizers import FusedAdam
from zero_from_scratch.sharding import Layout, Unit, shard_layout


class WholeUnit(Unit):
    """A unit every rank holds and steps whole (its 'shard' is the padded unit)."""

    def shard_range(self, rank: int) -> tuple[int, int]:
        return 0, self.padded


def _split(engine, units: list) -> tuple[list, list]:
    """Each unit's run of parameters cut where the expert group changes: (units, comm of each unit or None)."""
    comm_of = getattr(engine, "expert_comm_of", {})
    key = {n: p.group_name if is_moe_param(p) else None for n, p in engine.params_by_name.items()}
    out, comms = [], []
    for g, tag, params in units:
        runs: list = []
        for name, shape in params:
            k = key[name] if key[name] in comm_of else None
            if not runs or runs[-1][0] != k:
                runs.append((k, []))
            runs[-1][1].append((name, shape))
        for k, ps in runs:
            out.append((g, tag if len(runs) == 1 else f"{tag}.{k or 'dense'}", ps))
            comms.append(comm_of.get(k))
    return out, comms


def layout(engine, units: list, world_size: int) -> Layout:
    """shard_layout; with expert groups over a subgroup, their parameters in units of their own (engine.expert_comms:
    unit index → Comm), whole on every rank."""
    if not getattr(engine, "expert_comm_of", {}):
        return shard_layout(units, world_size)
    units, comms = _split(engine, units)
    engine.expert_comms = {i: c for i, c in enumerate(comms) if c is not None}
    lay = shard_layout(units, world_size)
    if world_size == 1:
        return lay
    sizes = sorted({c.size for c in engine.expert_comms.values()} - {1})    # a group of one partitions nothing
    if sizes and engine.comm.global_rank == 0:                  # ZeRO-1/2 here: a memory difference, said once
        warnings.warn(f"ZeRO-{engine.stage_id} with expert parallelism: each expert parameter is held whole, with its "
                      f"optimizer state, on every rank of its expert-data-parallel group (size {sizes}); DeepSpeed "
                      "would partition it over that group. Updates are the same; its memory is not", stacklevel=3)
    local, out = [0] * len(lay.group_local), []
    for u in lay.units:
        if u.index in engine.expert_comms:
            u = WholeUnit(**{**{f.name: getattr(u, f.name) for f in dataclasses.fields(u)}, "shard": u.padded})
        u = dataclasses.replace(u, local_offset=local[u.group])
        local[u.group] += u.shard
        out.append(u)
    return dataclasses.replace(lay, units=tuple(out), group_local=tuple(local))


def norm_ranges(engine):
    """Per unit, the slices of this rank's gradient shard its Σg² counts (step.py); None: all of it."""
    comms = getattr(engine, "expert_comms", {})
    if not comms or engine.stage_id == 0:
        return None
    out = []
    for u in engine.layout.units:
        c = comms.get(u.index)
        n = u.padded // c.size if c is not None else u.shard
        out.append([(c.rank * n, (c.rank + 1) * n)] if c is not None else [(0, n)])
    return out


def stage0_norm(engine, norm: float, scale: float) -> float:
    """The global norm ZeRO-0 clips by with MoE layers (module docstring, ZeRO-0); `norm`: the local one. Under the
    runner at stage 0 in 16 bits with any optimizer but FusedAdam: FP16_UnfusedOptimizer's own (unfused_norm)."""
    if getattr(engine, "ds_wrapper", False) and engine.mp is None and not fused_adam(engine):
        return unfused_norm(engine, scale)
    if engine.stage_id != 0 or not getattr(engine, "has_moe_layers", False):
        return norm
    if not engine.mixed:                     # runtime/utils.py clip_grad_norm_: the mean of the local norms
        if not getattr(engine, "expert_comms", {}):
            return norm
        t = torch.tensor([norm], dtype=torch.float32, device=engine.device) / engine.comm.size
        engine.comm.all_reduce(t, purpose="grad-norm mean (ZeRO-0, expert groups)")
        return t.item()
    groups, dense = engine.optimizer.param_groups, torch.zeros((), dtype=torch.float64, device=engine.device)
    experts = torch.zeros((), dtype=torch.float64, device=engine.device)
    fused = fused_adam(engine)
    for u in engine.layout.units:
        g = engine.stage.grad_shard(u)
        if fused:                            # by optimizer group: an "moe" group's norm over its ep group
            if is_moe_param_group(groups[u.group]):
                c = engine.expert_comm_of.get(groups[u.group]["name"])     # its expert-data-parallel group
                experts += sum_of_squares(g[:u.numel]) / (engine.comm.size if c is None else c.size)
            else:
                dense += sum_of_squares(g[:u.numel])
            continue
        for sl in u.slots:                   # by parameter: expert gradients only checked for overflow
            sq = sum_of_squares(g[sl.offset:sl.offset + sl.numel])
            if is_moe_param(engine.params_by_name[sl.name]):
                experts += 0 * sq            # 0 if finite; a non-finite one makes the total non-finite
            else:
                dense += sq
    if fused:
        engine.comm.all_reduce(experts, purpose="grad-norm expert all-reduce (ZeRO-0 fp16/bf16, MoE)")
    total = (dense + experts).item()
    return math.sqrt(total) / scale if math.isfinite(total) else float("inf")


def unfused_norm(engine, scale: float) -> float:
    """FP16_UnfusedOptimizer.step's norm in DeepSpeed's arithmetic (runtime/utils.py get_weight_norm, get_global_norm):
    per group, each non-expert gradient's fp32 norm, their squares added in fp32 in the group's order, the root of
    that sum taken in double; the groups' roots combined in double; an expert gradient only checked for overflow.
    Divided by `scale` (the loss scale the gradients carry: 1 in bf16), as ringzero reports norms. One pass."""
    where = {sl.name: (u, sl) for u in engine.layout.units for sl in u.slots}
    groups, bad = [], False
    for names in engine.group_names:            # DeepSpeed's order: each group's parameters as given
        acc = None
        for name in names:
            u, sl = where[name]
            t = engine.stage.grad_shard(u)[sl.offset:sl.offset + sl.numel].view(sl.shape)
            if is_moe_param(engine.params_by_name[name]):
                bad = bad or not bool(torch.isfinite(t).all())
                continue
            sq = t.float().norm(2) ** 2.0
            acc = sq if acc is None else acc + sq
        groups.append(0.0 if acc is None else float(acc.item()) ** 0.5)
    total = sum(n ** 2.0 for n in groups)
    return math.sqrt(total) / scale if math.isfinite(total) and not bad else float("inf")


def fused_adam(engine) -> bool:
    """Does DeepSpeed wrap this optimizer in FP16_Optimizer (FusedAdam) rather than FP16_UnfusedOptimizer?"""
    if engine.client_optimizer is not None:
        return isinstance(engine.client_optimizer, FusedAdam)
    raw = (engine.config.raw.get("optimizer") or {}).get("params") or {}
    return engine.config.optimizer.kind == "Adam" and not raw.get("torch_adam")


class ExpertUnits:
    """ZeroStage0/1/2's expert units (see the module docstring); a dense unit goes to the textbook's code."""

    def _make_param_storage(self) -> None:
        comms, init = getattr(self.e, "expert_comms", {}), getattr(self.e, "expert_init", {})
        super()._make_param_storage()
        for u in self.layout.units:
            if u.index in comms:
                for s in u.slots:
                    self.params[s.name].data.copy_(init[s.name])
                unit = self.flat[u.group][u.flat_offset:u.flat_offset + u.padded]
                comms[u.index].broadcast(unit, 0, **self.kw("init broadcast (expert data parallel)"))

    def _sum_into_block(self, b, u, then=None) -> None:
        c = getattr(self.e, "expert_comms", {}).get(u.index)
        if c is None:
            return super()._sum_into_block(b, u, then)
        self._launch(c.all_reduce(b, **self.kw("grad all-reduce (expert data parallel)", u)), then)

    def after_step(self) -> None:
        """The all-gather of the dense units only (the whole expert units are equal on every member)."""
        comms, whole = getattr(self.e, "expert_comms", {}), self.layout
        self.layout = dataclasses.replace(whole, units=tuple(u for u in whole.units if u.index not in comms))
        try:
            super().after_step()
        finally:
            self.layout = whole
