"""Mixture-of-experts parameters in the ZeRO engine, as DeepSpeed 0.19.8 treats them (runtime/engine.py,
runtime/zero/stage_1_and_2.py, moe/utils.py).

    python -m pytest -q -m slow tests/test_moe.py         (2 and 4 ranks: the runner against real DeepSpeed)
    names, hypers, kind, w_mode, shared = moe_params.plan(engine, model, model_parameters, param_groups)   # __init__

An expert parameter is one marked `allreduce = False` with a `group_name` "ep_size_E" (the MoE layer's
Experts do it, as_deepspeed/moe.py). prepare(): finds the MoE layers (has_moe_layers, num_experts,
moe_layers, gate_modules), calls every module's set_deepspeed_parallelism (the layers create their
expert-parallel / expert-data-parallel groups), and with the config's optimizer splits plain
model.parameters() into DeepSpeed's groups: {"name": "dense-params"} and one {"moe": True, "name":
"ep_size_E"} group per expert group (configure_moe_param_groups). At ZeRO-1/2 DeepSpeed's ZeRO
optimizer asserts what it asserts: an "moe" group exists, holds only expert parameters; ZeRO-2 needs
contiguous_gradients and reduce_scatter. Gradients: DeepSpeed sums an expert gradient over its
expert-data-parallel group and divides by the whole data-parallel world (engine.py
_reduce_expert_gradients "to maintain the gradients value unaffected by ep_size"; stage_1_and_2.py
average_tensor divides every bucket by the dp world size): with ep_size 1 that group is the world, so
the engine's one reduction and its ÷N at the step are DeepSpeed's, bit for bit.
With ep_size > 1 the expert groups are reduced over their expert-data-parallel group (moe_grads.py):
plan() gives the engine one Comm per such group (engine.expert_comm_of[group_name]) and the experts'
values before the engine's world broadcast (engine.expert_init); at ZeRO-1/2 each expert parameter
must then sit in an "moe" group of its own group_name (at ZeRO-0 DeepSpeed reduces per parameter, so
any group may hold them).
Refused, each with what DeepSpeed would have done: ZeRO-3 (DeepSpeed refuses native MoE there too),
an mpu (tensor-parallel token drop/gather around the experts), checkpoints (per-expert files
layer_*_expert_*_mp_rank_*_model_states.pt, expp_rank_* optimizer files).
Cost: one pass over the modules and parameters; the groups: moe layer's new_group calls (every rank).
"""
from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from zero_from_scratch.engine import client_optim
from zero_from_scratch.engine.comm import Comm
from zero_from_scratch.engine.precision import deepspeed_bf16_optimizer


def is_moe_param(param) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group) -> bool:
    return param_group.get("moe", False)


def moe_layers(module) -> list:
    """The MoE layers (DeepSpeed: isinstance(module, deepspeed.moe.layer.MoE); here its served class's marker)."""
    return [m for m in module.modules() if getattr(type(m), "is_deepspeed_moe", False)]


def has_moe_layers(m):
    layers = moe_layers(m)
    return (True, layers[0].num_experts) if layers else (False, 0)


def split_params_into_shared_and_expert_params(params):
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group):
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """Each group's expert parameters moved into copies of it named by their group_name, with "moe": True,
    appended after the groups (split into runs of ≤ max_group_size elements)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names = {p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)}
    moe = defaultdict(dict)
    for g in param_groups:                       # keyed by the group's name (a KeyError without one, as DeepSpeed)
        for key in names:
            moe[g["name"]][key] = {**g, "name": key, "moe": True, "params": []}
    for g in param_groups:
        kept = []
        for p in g["params"]:
            if is_moe_param(p):
                moe[g["name"]][p.group_name]["params"].append(p)
            else:
                kept.append(p)
        g["params"] = kept
    for by_name in moe.values():
        for g in by_name.values():
            if max_group_size is None:
                param_groups.append(g)
                continue
            runs, cur, size = [], [], 0
            for p in g["params"]:
                n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                if size + n <= max_group_size:
                    cur.append(p)
                    size += n
                else:
                    runs.append(cur)
                    cur, size = [p], n
            if cur:
                runs.append(cur)
            param_groups.extend({**g, "params": r} for r in runs)
    return param_groups


def configure_moe_param_groups(model_parameters):
    assert isinstance(model_parameters, list), "model_parameters must be a list"
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be "
                            f"an iterable of Tensors or dicts, but got {type(p)}")
    first = model_parameters[0]
    if isinstance(first, torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters


def _refuse(what: str, deepspeed_would: str) -> None:
    raise NotImplementedError(f"{what} is refused by ringzero: DeepSpeed would {deepspeed_would}")


def prepare(engine, model, model_parameters):
    """DeepSpeed's MoE set-up in initialize (see the module docstring); the model_parameters to use."""
    layers = moe_layers(model)
    engine.has_moe_layers, engine.num_experts = bool(layers), [m.num_experts for m in layers]
    engine.moe_layers = [m.deepspeed_moe for m in layers]
    engine.gate_modules = [m.deepspeed_moe.gate for m in layers]
    if layers:
        if engine.stage_id == 3:
            raise AssertionError("Native DeepSpeed MoE is not supported with ZeRO Stage 3. "
                                 "Use AutoEP or choose ZeRO stage 1/2.")
        if engine.parallel is not None:
            _refuse("MoE with an mpu", "drop and gather the experts' tokens over the tensor-parallel group")
        engine.expert_init = {n: p.detach().clone() for n, p in model.named_parameters() if is_moe_param(p)}
    before = engine.config.raw.get("use_data_before_expert_parallelism", False)
    for m in model.modules():                      # DeepSpeed calls it on any module that has it
        if hasattr(m, "set_deepspeed_parallelism"):
            m.set_deepspeed_parallelism(before)
    if not layers or engine.client_optimizer is not None:
        return model_parameters
    ps = list(model.parameters() if model_parameters is None else model_parameters)
    return configure_moe_param_groups(ps)


def plan(engine, model, model_parameters, param_groups):
    """client_optim.plan on the parameters prepare() gives, then DeepSpeed's ZeRO-1/2 MoE asserts."""
    out = client_optim.plan(model, prepare(engine, model, model_parameters), engine.client_optimizer, engine.config,
                            engine.comm.global_rank, param_groups)
    check_groups(engine, out[1], out[0])
    if engine.config.raw.get("wall_clock_breakdown"):      # engine.py: time_moe/time_*alltoall, the gates' gate_time
        for m in model.modules():
            if hasattr(m, "gate_time") or hasattr(m, "time_moe"):
                m.wall_clock_breakdown = True
    edp = {m.expert_group_name: m.expert_data_parallel_group for m in moe_layers(model) if m.ep_size > 1}
    engine.expert_comm_of = {name: Comm(engine.comm.impl, g) for name, g in edp.items()}   # moe_grads.layout's
    by_name = dict(model.named_parameters())
    for i, (ns, h) in enumerate(zip(out[0], out[1])):
        experts = {by_name[n].group_name for n in ns if is_moe_param(by_name[n])} & set(edp)
        if experts and engine.stage_id > 0 and not (is_moe_param_group(h) and len(experts) == 1):
            _refuse(f"ZeRO-{engine.stage_id} with param group {i} mixing {sorted(experts)} expert parameters with "
                    "others (ep_size > 1)", "partition that group over the data-parallel group and reduce its "
                    "expert slices over their expert-data-parallel group; put each group_name's expert parameters "
                    "in an 'moe' group of their own (split_params_into_different_moe_groups_for_optimizer)")
    return out


def check_groups(engine, hypers: list[dict], names: list[list[str]]) -> None:
    """DeepSpeed's ZeRO-1/2 optimizer's MoE asserts (stage_1_and_2.py _configure_moe_settings); where it builds
    its BF16_Optimizer instead (precision.deepspeed_bf16_optimizer), only that one's (bf16_optimizer.py):
    an "moe" group, holding MoE parameters only."""
    if not engine.has_moe_layers or engine.stage_id not in (1, 2):
        return
    z = engine.config.zero
    if not deepspeed_bf16_optimizer(engine.config, engine.stage_id):
        if engine.stage_id == 2:
            assert z.contiguous_gradients, ("Contiguous Gradients in ZeRO Stage 2 must be set to True for MoE. "
                                            "Other code paths are not tested with MoE")
        elif not z.contiguous_gradients and engine.comm.global_rank == 0:
            warnings.warn("ZeRO Stage 1 has not been thoroughly tested with MoE. This configuration is still "
                          "experimental.")
        assert z.reduce_scatter, ("Reduce Scatter in ZeRO Stage 2 must be set to True for MoE. "
                                  "Other code paths are not tested with MoE")
    assert any(is_moe_param_group(h) for h in hypers), (
        "The model has moe layers, but None of the param groups are marked as MoE. Create a param group with "
        "'moe' key set to True before creating optimizer")
    by_name = dict(engine.module.named_parameters())
    for h, ns in zip(hypers, names):
        if is_moe_param_group(h):
            assert all(is_moe_param(by_name[n]) for n in ns), "All params in MoE group must be MoE params"


def refuse_checkpoint(engine, verb: str) -> None:
    if getattr(engine, "has_moe_layers", False):
        _refuse(f"{verb}_checkpoint of a model with MoE layers",
                "write/read per-expert files (layer_*_expert_*_mp_rank_*_model_states.pt) and expp_rank_* "
                "optimizer files, which ringzero does not lay out")
