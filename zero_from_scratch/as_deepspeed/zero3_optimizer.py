"""DeepSpeed's ZeRO-3 optimizer names a test reads, on ringzero's engine.optimizer at stage 3.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    (quirks.expose_torch_optimizer installs them after initialize)

  isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)   true at stage 3 (runtime/zero/stage3.py's
                                  class); the class itself is never built here: DeepSpeed would wrap the client
                                  optimizer over its own fp32 partitions, ringzero's optimizer steps its shards
  engine.optimizer._get_norm_groups()   per parameter group, the L2 norm of the averaged gradient over every
                                  rank (fp16: before unscaling, as DeepSpeed's), read when called, so after
                                  safe_set_local_grad too; every rank calls it (it gathers)
  engine.optimizer._global_grad_norm    the norm the last step measured (engine.get_global_grad_norm())
  the stage's gathered units          a new buffer per gather, as DeepSpeed's (engine/z3_per_gather.py)
  engine.optimizer._set_fp32_optimizer_param_groups() / _clear_fp32_optimizer_param_groups()
                                  between the two, engine.optimizer.optimizer.state_dict() is DeepSpeed's
                                  (stage3.py: the flat fp32 partitions put into the torch optimizer's
                                  groups): per sub-group g, state[g] holds this rank's partition, each
                                  parameter's ceil(numel/N) piece (zero-padded) in the group's order
                                  (safe_api.ds_partition); ringzero's sub-groups are its param groups
                                  (zero_layout.py), so fp16_groups and this agree
  engine._get_zero_param_shapes()     per sub-group {name: full shape}, in the same order (runtime/engine.py)
  engine.optimizer.step()             DeepSpeed's ZeRO-3 optimizer step (stage3.py `step`): the engine's step (norm,
                                  overflow, clipping, update, persistent gather) without what its engine.step adds
                                  (the LR scheduler step, the global step and sample counts)
  engine.optimizer.zero_grad()        DeepSpeed's (micro_step_id ← 0): the accumulated gradient partitions stay (a
                                  step before the next backward still uses them) and each one's next reduction
                                  overwrites it instead of adding: its shard is zeroed just before that reduction
  engine.optimizer.get_fp32_grad_partitions()   {group: {index in group: averaged_gradients[group][index].float()}}
                                  (stage3.py); with offload_optimizer refused: DeepSpeed reads its fp32 host partitions
  engine.optimizer.grad_partitions_flat_buffer   refused: DeepSpeed's one buffer of every parameter's gradient
                                  partition, which after a step still holds that step's gradients; ringzero's shards
                                  are per param group and cleared by the step
Cost: _get_norm_groups gathers each parameter's full gradient (safe_get_full_grad), the fp32 state_dict
each parameter's full optimizer states: inspection calls (collectives, every rank calls them), not
training ones; the rest nothing.
"""
from __future__ import annotations

import types
import weakref
from collections import OrderedDict

import torch

from zero_from_scratch.as_deepspeed.finder import NotServedAttributeError, NotServedError, message
from zero_from_scratch.engine import z3_per_gather
from zero_from_scratch.engine.safe_api import ds_partition, safe_get_full_grad, safe_get_full_optimizer_state


class _Stage3Check(type):
    def __instancecheck__(cls, obj) -> bool:
        return type.__instancecheck__(cls, obj) or getattr(obj, "_ringzero_zero3", False) is True


class DeepSpeedZeroOptimizer_Stage3(metaclass=_Stage3Check):
    """isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3) at stage 3; building one is refused."""

    def __init__(self, *args, **kwargs):
        raise NotServedError(message("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3(...)",
                                     "wrap the client optimizer, stepping fp32 partitions laid out its way",
                                     "deepspeed.initialize at stage 3: engine.optimizer steps ringzero's shards"))


def norm_groups(engine) -> list[torch.Tensor]:
    out = []
    for names in engine.group_names:
        sq = torch.zeros((), dtype=torch.float32, device=engine.device)
        for n in names:
            g = safe_get_full_grad(engine.params_by_name[n])
            if g is not None:
                sq += g.float().pow(2).sum()
        out.append(sq.sqrt())
    return out


def zero_param_shapes(engine) -> list:
    layout = engine.layout
    return [OrderedDict((n, torch.Size(layout.where[n][1].shape))
                        for n in names) for names in engine.group_names]


def fp32_state_dict(engine) -> dict:
    """DeepSpeed's inner state_dict() while the flat fp32 partitions sit in its groups (stage3.py)."""
    opt, n, r = engine.optimizer, engine.comm.size, engine.comm.rank
    state, groups = {}, []
    for g, names in enumerate(engine.group_names):
        st = opt.state[g]
        state[g] = {k: (torch.tensor(float(v)) if k == "step" else torch.cat(
            [ds_partition(safe_get_full_optimizer_state(engine.params_by_name[m], k), n, r) for m in names]))
            for k, v in st.items()}
        groups.append({**{k: v for k, v in opt.param_groups[g].items() if k != "params"}, "params": [g]})
    return {"state": state, "param_groups": groups}


FLAT_GRADS = message("engine.optimizer.grad_partitions_flat_buffer at ZeRO-3",
                    "keep every parameter's gradient partition in one flat buffer, still holding the last step's "
                    "gradients after the step", "ringzero's gradient shards are per param group and cleared by the "
                    "step: engine.optimizer.averaged_gradients, or deepspeed.utils.safe_get_local_grad(p)")


def optimizer_step(engine) -> None:
    sched, counts = engine.lr_scheduler, (engine.global_steps, engine.global_samples)
    engine.lr_scheduler = None               # DeepSpeed's engine.step steps it, its optimizer's step does not
    try:
        engine._optimizer_step()
    finally:
        engine.lr_scheduler, (engine.global_steps, engine.global_samples) = sched, counts


def zero_grad(engine) -> None:
    st = engine.stage
    if "_reduce" not in vars(st):            # once: each unit's first reduction after zero_grad starts from zero
        reduce, st.overwrite_next = st._reduce, set()

        def _reduce(u):
            if u.index in st.overwrite_next:
                st.overwrite_next.discard(u.index)
                st.grad_shard(u).zero_()
            reduce(u)
        st._reduce = _reduce
    engine.allreduce_gradients()             # reductions still in flight (overlap_comm) land first
    st.overwrite_next.update(u.index for u in engine.layout.units)


def fp32_grad_partitions(engine) -> dict:
    """DeepSpeed's get_fp32_grad_partitions without optimizer offload: the averaged gradients (z3_grads.py), in fp32."""
    if engine.offload is not None:
        raise NotImplementedError("engine.optimizer.get_fp32_grad_partitions() with offload_optimizer is not served: "
                                  "DeepSpeed would read the gradients of its fp32 partitions on the host; "
                                  "use deepspeed.utils.safe_get_local_grad(p)")
    avg = engine.optimizer.averaged_gradients
    return {g: {i: grad.float() for i, grad in enumerate(avg[g])} for g in avg}


_WITH_NORM: dict = {}


def _with_norm(cls):
    """cls with DeepSpeed's _global_grad_norm read from the engine (a subclass: isinstance(cls) still holds)."""
    if cls not in _WITH_NORM:
        _WITH_NORM[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__doc__": cls.__doc__,
            "_global_grad_norm": property(lambda self: self._ringzero_engine()._global_grad_norm)})
    return _WITH_NORM[cls]


def install(engine) -> None:
    if engine.stage_id != 3:
        return
    z3_per_gather.allocate_per_gather(engine.stage)     # DeepSpeed's buffers: one per gather
    opt, ref = engine.optimizer, weakref.ref(engine)
    opt._ringzero_zero3, opt._ringzero_engine = True, ref
    opt._get_norm_groups = lambda: norm_groups(ref())
    opt.get_fp32_grad_partitions = lambda: fp32_grad_partitions(ref())
    if getattr(opt.step, "_wrapped_by_lr_sched", False):   # a torch LR scheduler built at initialize wrapped it
        opt.step = lambda closure=None: optimizer_step(ref())
        opt.step._wrapped_by_lr_sched = True            # it counts the call through step.py's _opt_called
    else:                                               # a method: a scheduler built later wraps its __func__
        opt.step = types.MethodType(lambda self, closure=None: optimizer_step(self._ringzero_engine()), opt)
    opt.__dict__.setdefault("refused_names", {})["grad_partitions_flat_buffer"] = NotServedAttributeError(FLAT_GRADS)
    opt.zero_grad = lambda set_to_none=True: zero_grad(ref())
    opt._ringzero_fp32_groups = False
    opt._set_fp32_optimizer_param_groups = lambda: setattr(opt, "_ringzero_fp32_groups", True)
    opt._clear_fp32_optimizer_param_groups = lambda: setattr(opt, "_ringzero_fp32_groups", False)
    engine._get_zero_param_shapes = lambda: zero_param_shapes(ref())
    opt.__class__ = _with_norm(type(opt))
