"""engine.offload_states / reload_states: move chosen training states to the host between steps and back.

    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])   # e.g. before generation in RLHF
    engine.reload_states()                                               # before the next forward

DeepSpeed 0.19.8 (runtime/engine.py offload_states, zero/stage_1_and_2.py and stage3.py) names five
states; on this engine they are these tensors (one list per parameter group):
  optim_states            engine.optimizer.state[g][k], k in the optimizer's STATE (Adam: exp_avg, exp_avg_sq)
  hp_params               engine.master[g], the fp32 master (bf16/fp16); in fp32 the master IS the
                          parameters' storage, so it moves with lp_params
  lp_params               stages 1-2: stage.flat[g] (every parameter is a view of it); stage 3: stage.pshard[g]
  lp_grads                stage 1: stage.gflat[g]; stages 2-3: stage.gshard[g]
  contiguous_grad_buffer  DeepSpeed's stage-3 reduce bucket (freed, not kept); this engine allocates its
                          reduce buckets per unit and drops them, so nothing is held between steps
Moving a state copies each of its storages into a host buffer (pinned when pin_memory and a CUDA
device exist) and shrinks the storage on the engine's device to 0 bytes; reload grows it back and
copies the bytes in. The tensor objects and every view of them (the parameters, the optimizer's
slices, the gradient hooks' views) stay the engine's own, so no reference needs relinking. A
tensor over a 0-byte storage must not be read (torch does not check: it would read freed memory),
so until reload_states the engine's forward, backward, step and checkpoint calls raise (GUARDED);
reading a parameter directly in between is the caller's error. DeepSpeed's checks and words are kept: offloaded
parameters (offload_param) and stage 3 without an optimizer refuse, nvme raises, device none
warns, and with offload_optimizer the states already on the host (optim_states, hp_params; at
stage 3 lp_grads too) are left out.
Cost: one copy of each chosen state each way; host memory for the copies while offloaded.
"""
from __future__ import annotations

import logging
from enum import Enum

import torch

log = logging.getLogger(__name__)
GUARDED = ("forward", "backward", "step", "save_checkpoint", "load_checkpoint")


class OffloadStateTypeEnum(str, Enum):
    """ Enum for internal buffer types """
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def state_tensors(engine, state: OffloadStateTypeEnum) -> list[torch.Tensor]:
    """The engine's tensors that hold `state` (the table in the module docstring)."""
    st = engine.stage
    if state == OffloadStateTypeEnum.optim_states:
        return [s[k] for s in engine.optimizer.state for k in engine.optimizer.STATE if torch.is_tensor(s.get(k))]
    if state == OffloadStateTypeEnum.hp_params:
        return list(engine.master) if engine.mixed else state_tensors(engine, OffloadStateTypeEnum.lp_params)
    if state == OffloadStateTypeEnum.lp_params:
        return list(st.pshard if engine.stage_id == 3 else st.flat)
    if state == OffloadStateTypeEnum.lp_grads:
        return list(getattr(st, "gshard", None) or getattr(st, "gflat", []))
    return []    # contiguous_grad_buffer: no reduce bucket outlives its unit here


def refine_include(engine, include):
    """DeepSpeedEngine._refine_include_states: all states by default; with offload_optimizer the ones
    already on the host are left out (at stage 3 lp_grads too)."""
    include = list(OffloadStateTypeEnum) if include is None else [OffloadStateTypeEnum(x) for x in include]
    if engine.config.offload_optimizer is not None:
        out = [OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states]
        if engine.stage_id == 3:
            out.append(OffloadStateTypeEnum.lp_grads)
        include = [x for x in include if x not in out]
    return include


def _check(engine) -> None:
    """DeepSpeed's assertion (engine.py): ZeRO-3 with no optimizer has no states to move."""
    assert not (engine.stage_id == 3 and engine.client_optimizer is None
                and not engine.config.raw.get("optimizer")), \
        "Moving states across devices is not supported without an optimizer."


def _zero_optimizer(engine) -> None:
    """Stage 0: DeepSpeed's optimizer there (torch's, or its fp16/bf16 wrapper) has no offload_states."""
    if engine.stage_id == 0:
        raise AttributeError(f"'{type(engine.optimizer).__name__}' object has no attribute 'offload_states' "
                             "(DeepSpeed moves states of its ZeRO optimizers only: stages 1-3)")


def _fused_adam(engine) -> bool:
    """Whether DeepSpeed would step this engine with its FusedAdam (stage3.py asserts it)."""
    raw = (engine.config.raw.get("optimizer") or {}).get("params") or {}
    return engine.client_optimizer is None and engine.config.optimizer.kind == "Adam" and not raw.get("torch_adam")


def offload_states(engine, include=None, device="cpu", pin_memory: bool = True,
                   non_blocking: bool = False) -> None:
    """Copy each chosen state to `device` and free it on the engine's device (see the module docstring)."""
    include = refine_include(engine, include)
    assert engine.config.offload_param is None, "Moving states across devices is not supported for offloaded parameters."
    _check(engine)
    device = getattr(device, "value", device)    # OffloadDeviceEnum (a str Enum) or its string
    if device == "none":
        log.warning("No device specified for offloading states.")
        return
    if device == "nvme":
        raise ValueError("NVMe offload is not supported for offloading states.")
    _zero_optimizer(engine)
    held = engine.__dict__.setdefault("offloaded_states", {})    # state → [(storage, host copy, nbytes)]
    todo = [s for s in include if s not in held]
    if engine.stage_id == 3 and {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params} & set(todo):
        assert _fused_adam(engine), "Offloading is supported only for DeepSpeed FusedAdam."
    if hasattr(engine.stage, "release_all"):
        engine.empty_partition_cache()                           # stage3.py does this first
    moved = {id(m[0]): m for moves in held.values() for m in moves}
    pin = pin_memory and torch.cuda.is_available()
    for state in todo:
        moves = []
        for t in state_tensors(engine, state):
            s = t.untyped_storage()
            if id(s) in moved:                                   # hp_params in fp32: lp_params' storage
                moves.append(moved[id(s)])
                continue
            if s.nbytes() == 0:
                continue
            host = torch.empty(s.nbytes(), dtype=torch.uint8, device=device, pin_memory=pin)
            host.untyped_storage().copy_(s, non_blocking=non_blocking)
            moves.append(moved.setdefault(id(s), (s, host, s.nbytes())))
            s.resize_(0)
        held[state] = moves
    if moved:                                                    # instance attributes shadow the methods
        for name in GUARDED:
            engine.__dict__[name] = _refuse(name, [s.value for s, m in held.items() if m])


def _refuse(name, states):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"engine.{name}() while its states {states} are offloaded "
                           "(engine.offload_states): call engine.reload_states() first")
    return refuse


def reload_states(engine, non_blocking: bool = False) -> None:
    """Bring every offloaded state back into the engine's own tensors."""
    _check(engine)
    _zero_optimizer(engine)
    for name in GUARDED:
        engine.__dict__.pop(name, None)
    moves = engine.__dict__.pop("offloaded_states", {}).values()
    for s, host, nbytes in {id(m[0]): m for ms in moves for m in ms}.values():   # a shared storage once
        s.resize_(nbytes)
        s.copy_(host.untyped_storage(), non_blocking=non_blocking)


def get_state_devices(model, state: OffloadStateTypeEnum) -> set:
    """deepspeed.runtime.zero.offload_states.get_state_devices: where `state`'s bytes are now (the
    host copies' device while offloaded); empty for a state that holds no tensors."""
    moves = model.__dict__.get("offloaded_states", {}).get(OffloadStateTypeEnum(state))
    if moves is not None:
        return {h.device for _, h, _ in moves}
    return {t.device for t in state_tensors(model, OffloadStateTypeEnum(state))}
