"""DeepSpeed's ZeRO-1/2 optimizer classes under the runner: `isinstance` where DeepSpeed builds one, and
BF16_Optimizer's gradient buffers, on ringzero's engine.optimizer.

    python -m zero_from_scratch.as_deepspeed train.py      (deepspeed.initialize calls install(engine))
    python -m pytest tests/test_ds_optimizer_classes.py   (2 ranks, against one-process torch)

DeepSpeed 0.19.8 (runtime/engine.py, the optimizer wrapper choice) wraps the client optimizer at stages 1-2
in stage_1_and_2.DeepSpeedZeroOptimizer, except for bf16 + data_types.grad_accum_dtype fp32 at stage 1
without CPU optimizer offload (nvme offload included): there in bf16_optimizer.BF16_Optimizer, and
compute_grad_norm false there raises ValueError, as DeepSpeed's _do_optimizer_sanity_check. isinstance(engine.optimizer, either) holds here
where DeepSpeed's would. Building one, or using an internal method of one made with __new__, is refused with
what DeepSpeed's would do (ringzero's optimizer steps its own shards; it has neither class's layout).

BF16_Optimizer's gradients add into fp32 flat buffers, one per parameter group (`fp32_groups_gradients_flat`),
and at the accumulation boundary engine.allreduce_gradients ALL-REDUCES them (the mean over the ranks; no
reduce-scatter on that path), so every rank holds the whole averaged gradient before step() updates its own
partition. ringzero's stage 1 accumulates in fp32 there already (precision.grad_dtype); under the runner it
all-reduces too (the engine's `reduce_scatter: false` path), and
  engine.optimizer.fp32_groups_gradients_flat   per group, the fp32 gradient (DeepSpeed's order and padding):
                                                this rank's sum between boundaries, the average after the
                                                boundary's reduction.
                                                Read when read (a new tensor each time: writing into it
                                                changes nothing here, where DeepSpeed's is the buffer).
Cost: in that configuration the boundary moves 2(N-1)/N·Ψ gradient elements per rank instead of
(N-1)/N·Ψ, as DeepSpeed's does; ringzero's own entry points keep the reduce-scatter.
"""
from __future__ import annotations

import weakref

import torch

from zero_from_scratch.as_deepspeed.finder import NotServedAttributeError, NotServedError, message
from zero_from_scratch.engine.precision import deepspeed_bf16_optimizer

WRAP = ("wrap the client optimizer in its own class, stepping fp32 partitions of its flat bit16 groups",
        "deepspeed.initialize: engine.optimizer steps ringzero's shards (safe_get_full_* reads any parameter's)")
# an internal a test or script calls on an instance made with __new__ -> (what DeepSpeed's does, nearest here)
_UC = ("cache its parameters' autoTP universal-checkpoint info (UNIVERSAL_CHECKPOINT_INFO) for ds_to_universal",
       "ds_to_universal converts ringzero's ZeRO folders without it (as_deepspeed/ds_to_universal.py): the info "
       "describes AutoTP slices, and ringzero refuses AutoTP")
_SMALL = ("all-reduce a bucket of small gradients flattened together and copy each result back, recording "
          "the reduction stream on every tensor (CUDA streams under overlap_comm)",
          "ringzero's stages reduce each unit's bucket with one collective (engine/stages.py)")
INTERNALS = {"_enable_universal_checkpoint": _UC, "_get_universal_checkpoint_info": _UC,
             "allreduce_and_copy": _SMALL, "allreduce_and_copy_with_multiple_ranks": _SMALL}


class _Served(type):
    def __instancecheck__(cls, obj) -> bool:
        return type.__instancecheck__(cls, obj) or getattr(obj, "_ringzero_is", None) == cls.__name__


class _Wrapper(metaclass=_Served):
    _name = ""

    def __init__(self, *args, **kwargs):
        raise NotServedError(message(f"{self._name}(...)", *WRAP))

    def __getattr__(self, attr):       # an instance made with __new__: only what it was given
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotServedAttributeError(message(f"{self._name}.{attr}", *INTERNALS.get(attr, WRAP)))


class BF16_Optimizer(_Wrapper):
    """DeepSpeed's bf16 + fp32-accumulation wrapper at stage 1 (runtime/bf16_optimizer.py)."""
    _name = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"


class DeepSpeedZeroOptimizer(_Wrapper):
    """DeepSpeed's ZeRO stage 1-2 optimizer (runtime/zero/stage_1_and_2.py)."""
    _name = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"


def bf16_chosen(engine) -> bool:
    """DeepSpeed's choice of BF16_Optimizer (engine/precision.py deepspeed_bf16_optimizer)."""
    return deepspeed_bf16_optimizer(engine.config, engine.stage_id)


def fp32_gradients(engine) -> list[torch.Tensor]:
    """DeepSpeed's fp32_groups_gradients_flat: per group its parameters' gradients in the group's order, zeros
    to a multiple of 2·N elements (its nccl_start_alignment_factor 2 × the ranks). ringzero's buffer lays the
    units out in backward order and holds sums of gradients × `pre`; the reduced ones the step divides by
    post_divisor × the loss scale (grad_keys.py)."""
    r, st, n = engine.config.reduction, engine.stage, engine.comm.size
    local = engine._grads_local or n == 1
    div = (r.pre if local else r.post_divisor) * engine.loss_scaler.loss_scale
    out = []
    for names in engine.group_names:
        flat = torch.cat([st.gview[x].reshape(-1) for x in names]).float() / div
        out.append(torch.nn.functional.pad(flat, (0, -flat.numel() % (2 * n))))
    return out


_WITH_GRADS: dict = {}


def install(engine) -> None:
    if getattr(engine, "stage_id", None) not in (1, 2) or not hasattr(engine, "group_names"):
        return      # stage 0 / 3 (zero3_optimizer.py), or the pipeline engine
    opt = engine.optimizer
    if not bf16_chosen(engine):
        opt._ringzero_is = DeepSpeedZeroOptimizer.__name__
        return
    if not (engine.config.get("zero_optimization") or {}).get("compute_grad_norm", True):
        raise ValueError("zero_optimization.compute_grad_norm=false does not support ZeRO Stage 1 with "
                         "BF16 parameters and FP32 gradient accumulation")      # DeepSpeed's sanity check
    opt._ringzero_is = BF16_Optimizer.__name__
    engine.stage.reduce_scatter = False          # DeepSpeed's allreduce_gradients: the whole mean on every rank
    cls = type(opt)
    if cls not in _WITH_GRADS:
        _WITH_GRADS[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__doc__": cls.__doc__,
            "fp32_groups_gradients_flat": property(lambda self: fp32_gradients(self._ringzero_bf16_engine()))})
    opt._ringzero_bf16_engine = weakref.ref(engine)
    opt.__class__ = _WITH_GRADS[cls]
