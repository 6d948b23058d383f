"""DeepSpeed's safe_get_* / safe_set_* (deepspeed/utils/tensor_fragment.py) on the ZeRO engine:
one parameter's full fp32 weight, gradient or optimizer state, read from (or written into) the
shards, at stages 0-3.

    from zero_from_scratch.engine.safe_api import safe_get_full_fp32_param, safe_get_full_grad
    w = safe_get_full_fp32_param(model.fc.weight)      # EVERY rank calls it (a collective)

Semantics, as DeepSpeed 0.19.8's:
  get_full_fp32_param   the fp32 master (the parameter itself in fp32 runs), full shape, fp32
  get_full_grad         between backward and step: the reduced gradient, averaged over ranks, still
                        multiplied by the fp16 loss scale (DeepSpeed unscales only inside step);
                        at stages 0-1 before the boundary and inside engine.no_sync() (nothing
                        reduced yet) this rank's own gradient, as DeepSpeed's param.grad there
  get_full_optimizer_state(param, key)   key: the optimizer's state name ("exp_avg", "exp_avg_sq"
                        for Adam, "exp_avg" for Lion, "momentum_buffer" for SGD, "sum" for Adagrad)
  set_full_*            every rank passes the full value; each keeps its own shard of it. A
                        weight changes at the next step, as in DeepSpeed (whose fp32 partition is
                        apart from the weights forward uses, fp32 runs included): in mixed precision
                        the master is set and the step copies it back; in fp32, where the shard IS
                        the weight, the value waits in engine.pending_fp32 (get returns it) and the
                        step writes it before updating
A parameter the engine does not train (frozen, or not an engine's) gives None, as DeepSpeed's.
safe_get_local_* / safe_set_local_* (ZeRO-3 only, as DeepSpeed asserts): DeepSpeed's partition of
the parameter, ds_partition (padded to a multiple of N, rank r's ceil(numel/N) elements), which is
not our unit shard: get = the full value's partition; set = an all-gather of every rank's partition.
Cost: get = one all-gather of the parameter's unit(s) ((N-1)/N of its unit's elements per rank);
set = no communication. safe_update_full_grad_vectorized(params, fn): a get and a set per parameter.
The engine registers its parameters at initialise (register()).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch

from zero_from_scratch.engine import z3_ds_tensor

ATTR = "_ringzero_engine"        # on each trained parameter: (weakref to its engine, its name)


def register(engine) -> None:
    ref = weakref.ref(engine)
    for name, p in engine.params_by_name.items():
        setattr(p, ATTR, (ref, name))


def _owner(param):
    tag = getattr(param, ATTR, None)
    if tag is None or not param.requires_grad:
        return None, None
    engine = tag[0]()
    return (engine, tag[1]) if engine is not None else (None, None)


@contextlib.contextmanager
def _states_in_memory(engine):
    """nvme offload keeps the states in files: bring them in for the call (offload.py)."""
    with (engine.offload.in_memory() if hasattr(engine.offload, "in_memory") else contextlib.nullcontext()):
        yield


def _local(engine, u, what: str, key=None) -> torch.Tensor:
    """This rank's shard of unit u: "master" (fp32 weight), "grad" or an optimizer state."""
    sl = slice(u.local_offset, u.local_offset + u.shard)
    if what == "grad":           # the SUM over ranks (× loss scale × pre); _get divides to the mean
        return engine.stage.grad_shard(u)
    if what == "master":
        return engine.master[u.group][sl] if engine.mixed else z3_ds_tensor.master_of(engine, u)   # fp32: the shard
    st = engine.optimizer.state[u.group]
    if key not in engine.optimizer.STATE:
        raise KeyError(f"optimizer state {key!r} does not exist for {engine.optimizer.name}; it keeps "
                       f"{list(engine.optimizer.STATE)}")
    return st[key][sl]


def _get(param, what: str, key=None):
    engine, name = _owner(param)
    if engine is None:
        return None
    if what == "master" and name in getattr(engine, "pending_fp32", {}):
        return engine.pending_fp32[name].clone()
    if what == "grad" and engine._grads_local:   # no_sync, mid-accumulation at stages 0-1, a coalesce block:
        return engine.local_grad(name)           # this rank's own sum, as DeepSpeed's .grad (coalesce.py)
    ui, slot = engine.layout.where[name]
    u = engine.layout.units[ui]
    with _states_in_memory(engine):
        shard = _local(engine, u, what, key).float()
        if what == "grad":
            shard = shard / engine.config.reduction.post_divisor
        if engine.stage_id == 0 or engine.comm.size == 1 or u.shard == u.padded:   # the last: moe_grads.WholeUnit
            full = shard
        else:
            full = torch.empty(u.padded, dtype=torch.float32, device=engine.device)
            engine.comm.all_gather_single(full, shard.contiguous(), purpose="safe_get all-gather")
            engine.comm.usage.pop("safe_get all-gather", None)     # not a per-step cost in comm_report
    return full[slot.offset:slot.offset + slot.numel].clone().view(slot.shape)


def _set(param, value: torch.Tensor, what: str, key=None) -> None:
    engine, name = _owner(param)
    if engine is None:
        return
    ui, slot = engine.layout.where[name]
    u = engine.layout.units[ui]
    if value.numel() != slot.numel:
        raise ValueError(f"rank {engine.comm.global_rank}: safe_set for {name!r}: {value.numel()} elements given, "
                         f"the parameter has {slot.numel} {tuple(slot.shape)}")
    lo, hi = u.shard_range(engine.stage.owner())
    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)     # this rank's part of the parameter
    flat = value.detach().reshape(-1).to(device=engine.device)
    with _states_in_memory(engine), torch.no_grad():
        if a < b:
            _local(engine, u, what, key)[a - lo:b - lo].copy_(flat[a - slot.offset:b - slot.offset])
        if what == "master" and not engine.mixed and engine.stage_id in (1, 2):
            engine.stage.flat[u.group][u.flat_offset + slot.offset:u.flat_offset + slot.offset + slot.numel].copy_(flat)
        if what == "master" and engine.offload is not None and not engine.mixed:
            engine.offload.write_master()


def safe_get_full_fp32_param(param):
    return _get(param, "master")


def safe_set_full_fp32_param(param, value) -> None:
    engine, name = _owner(param)
    if engine is not None and not engine.mixed:       # the weight forward uses must not change before the step
        slot = engine.layout.where[name][1]
        if value.numel() != slot.numel:
            raise ValueError(f"rank {engine.comm.global_rank}: safe_set for {name!r}: {value.numel()} elements given, "
                             f"the parameter has {slot.numel} {tuple(slot.shape)}")
        engine.pending_fp32 = {**getattr(engine, "pending_fp32", {}), name: value.detach().float().reshape(slot.shape)}
        return
    _set(param, value, "master")


def apply_pending(engine) -> None:
    """At the optimizer step (step.py), before the update: fp32 weights set since the last step."""
    for name, value in getattr(engine, "pending_fp32", {}).items():
        _set(engine.params_by_name[name], value, "master")
    engine.pending_fp32 = {}


def safe_get_full_grad(param):
    return _get(param, "grad")


def safe_set_full_grad(param, value) -> None:
    """value: the averaged (loss-scaled) gradient, as safe_get_full_grad returns it."""
    engine, _ = _owner(param)
    if engine is not None:
        value = value * engine.config.reduction.post_divisor
    _set(param, value, "grad")


def safe_update_full_grad_vectorized(param_list, update_func) -> None:
    """DeepSpeed's: each parameter's full gradient becomes update_func(full gradient, param); one that
    still holds its .grad is updated in place, a trained one whose gradient lives in the shards is read
    and written with safe_get/set_full_grad (a collective: every rank passes the same list)."""
    for p in param_list:
        if p.grad is not None:
            p.grad.copy_(update_func(p.grad, p))
        elif p.requires_grad and _owner(p)[0] is not None:
            safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))


def safe_get_full_optimizer_state(param, optim_state_key: str):
    return _get(param, "state", optim_state_key)


def safe_set_full_optimizer_state(param, value, optim_state_key: str) -> None:
    _set(param, value, "state", optim_state_key)


# ----------------------------------------------------------------------------- DeepSpeed's ZeRO-3 partitions
def ds_partition(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """DeepSpeed's stage-3 partition r of a tensor: flattened, padded to a multiple of n, equal pieces."""
    p = math.ceil(t.numel() / n)
    flat = torch.cat([t.reshape(-1), t.new_zeros(p * n - t.numel())])
    return flat[r * p:(r + 1) * p].clone()


def _stage3(param):
    engine, _ = _owner(param)
    if engine is None and hasattr(param, "ds_id") and not param.requires_grad:
        return None      # DeepSpeed: a frozen ZeRO-3 parameter has no fp32 partition, its safe_*_local_* give None
    if engine is None or engine.stage_id != 3:
        raise AssertionError("This API is only defined for ZeRO-3 partitioned parameters")   # DeepSpeed's assert
    return engine


def _get_local(param, what: str, key=None):
    engine = _stage3(param)
    if engine is None:
        return None
    return ds_partition(_get(param, what, key), engine.comm.size, engine.comm.rank)


def _set_local(param, value, what: str, key=None) -> None:
    engine = _stage3(param)
    if engine is None:
        return
    n = engine.comm.size
    mine = value.detach().reshape(-1).float().to(engine.device).contiguous()
    everyone = torch.empty(n * mine.numel(), dtype=torch.float32, device=engine.device)
    engine.comm.all_gather_single(everyone, mine, purpose="safe_set all-gather")
    engine.comm.usage.pop("safe_set all-gather", None)
    _, name = _owner(param)
    slot = engine.layout.where[name][1]
    full = everyone[:slot.numel].view(slot.shape)
    if what == "master":
        return safe_set_full_fp32_param(param, full)
    _set(param, full * (engine.config.reduction.post_divisor if what == "grad" else 1.0), what, key)


def safe_get_local_fp32_param(param):
    return _get_local(param, "master")


def safe_set_local_fp32_param(param, value) -> None:
    _set_local(param, value, "master")


def safe_get_local_grad(param):
    return _get_local(param, "grad")


def safe_set_local_grad(param, value) -> None:
    _set_local(param, value, "grad")


def safe_get_local_optimizer_state(param, optim_state_key: str):
    return _get_local(param, "state", optim_state_key)


def safe_set_local_optimizer_state(param, value, optim_state_key: str) -> None:
    _set_local(param, value, "state", optim_state_key)
