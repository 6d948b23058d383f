"""deepspeed.utils.groups' expert-parallel process groups, and runtime.utils' overflow and norm checks that
reduce over them (DeepSpeed 0.19.8's utils/groups.py, runtime/utils.py), under the runner.

    import deepspeed.utils.groups as groups                  (python -m zero_from_scratch.as_deepspeed SCRIPT)
    groups._create_expert_and_data_parallel(2)             # every rank calls it (it creates process groups)
    overflow = deepspeed.runtime.utils.CheckOverflow([params]).check()

Groups: the legacy layout DeepSpeed builds without model parallelism (mp_size None or 1), per
pipeline stage of pp_stride = world/pp ranks: expert-parallel groups of expert_parallel_size_
consecutive ranks (strided by pp_stride/E with use_data_before_expert_parallel_), expert-data-
parallel groups strided by E (consecutive runs with use_data_before_expert_parallel_), each named
"ep_size_E", created once: the groups the MoE layer (moe.py) routes its tokens over and the engine
reduces expert gradients over (engine/moe_params.py), and the checks a script uses around expert
parameters (`param.allreduce = False`). The _get_expert_* accessors: a group's dict, world size,
rank, broadcast source (its first global rank); the expert tensor-parallel size is 1 (ringzero
creates no expert tensor-parallel groups). With mp_size > 1 (AutoEP's tensor-parallel orderings) refused.
CheckOverflow(param_groups, mpu, zero_reduce_scatter, deepspeed): check() — a NaN/inf in any gradient,
MAX-reduced over the largest expert-parallel group when a parameter is an expert one, then over the
world (zero_reduce_scatter) or the model-parallel group (mpu); check_using_norm(norms) — a norm that is
inf/NaN/negative, reduced the same way, then over the world unless reduce_overflow=False.
get_weight_norm(parameters, norm_type, mpu): the p-norm of the tensors' values (summed over the model-
parallel group with an mpu; tensor-parallel replicas counted on tensor-parallel rank 0 only), -1 when
not finite. As DeepSpeed's, the flags and norms are built with get_accelerator().FloatTensor /
ByteTensor (on the GPU under cuda, where the backend is nccl) and reduced with the served deepspeed.comm
names (so a script's patch of dist.all_reduce sees them).
Cost: creating groups: one new_group per group (every rank); a check: one 1-element all-reduce per group named.
"""
from __future__ import annotations

import math
import sys

import torch

from zero_from_scratch.as_deepspeed import comm as _own_comm
from zero_from_scratch.as_deepspeed.accelerator import get_accelerator
from zero_from_scratch.as_deepspeed.finder import ServedModule
from zero_from_scratch.as_deepspeed.utils import log_dist
from zero_from_scratch.engine.moe_params import is_moe_param

_EXPERT_PARALLEL_GROUP: dict = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict = {}
_EXPERT_DATA_PARALLEL_GROUP: dict = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict = {}


def _dist():
    """The runner's served deepspeed.comm (its own module object: a script's patch of its names sees
    these calls, as DeepSpeed's runtime/utils.py calls it), else as_deepspeed/comm.py itself."""
    served = isinstance(sys.modules.get("deepspeed"), ServedModule)
    return sys.modules.get("deepspeed.comm", _own_comm) if served else _own_comm


def _create_expert_and_data_parallel(expert_parallel_size_, mp_size=None, pp_size=None, mp_mode="tp",
                                     use_data_before_expert_parallel_=False, folding_spec=None) -> None:
    dist = _dist()
    assert dist.is_initialized()
    if (mp_size or 1) > 1:
        raise NotImplementedError(
            f"groups._create_expert_and_data_parallel(mp_size={mp_size}) is not served by ringzero: DeepSpeed would "
            "order the expert groups around tensor/sequence-parallel ranks (AutoEP); ringzero serves the layout "
            "without model parallelism (mp_size None or 1)")
    log_dist(f"Creating expert and data parallel groups with size {expert_parallel_size_}", ranks=[0])
    world, rank, ep = dist.get_world_size(), dist.get_rank(), expert_parallel_size_
    pp_stride = world // (pp_size or 1)
    if pp_stride % ep:
        raise AssertionError(f"{pp_stride} is not divisible by {ep}")    # DeepSpeed's _ensure_divisibility
    ep_stride, name = pp_stride // ep, f"ep_size_{ep}"
    if name not in _EXPERT_DATA_PARALLEL_GROUP:
        for start in range(0, world, pp_stride):
            for i in range(ep):
                ranks = (range(start + i * ep_stride, start + (i + 1) * ep_stride) if use_data_before_expert_parallel_
                         else range(start + i, start + pp_stride, ep))
                _keep(dist.new_group(list(ranks)), ranks, rank, name, _EXPERT_DATA_PARALLEL_GROUP,
                      _EXPERT_DATA_PARALLEL_GROUP_RANKS)
    if name not in _EXPERT_PARALLEL_GROUP:
        if use_data_before_expert_parallel_:
            all_ranks = [range(s + i, s + pp_stride, ep_stride) for s in range(0, world, pp_stride) for i in range(ep_stride)]
        else:
            all_ranks = [range(i * ep, (i + 1) * ep) for i in range(world // ep)]
        for ranks in all_ranks:
            _keep(dist.new_group(list(ranks)), ranks, rank, name, _EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS)


def _keep(group, ranks, rank, name, groups, group_ranks) -> None:
    if rank in ranks:
        groups[name], group_ranks[name] = group, ranks


def _get_max_expert_size():
    assert _EXPERT_PARALLEL_GROUP is not None, "Warning! Process group not initialized"
    sizes = [int(k.split("_")[2]) for k in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_expert_parallel_group(group_name):
    assert group_name in _EXPERT_PARALLEL_GROUP, "expert parallel group is not initialized"
    return _EXPERT_PARALLEL_GROUP[group_name]


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_data_parallel_group(group_name):
    assert group_name in _EXPERT_DATA_PARALLEL_GROUP, "expert data parallel group is not initialized"
    return _EXPERT_DATA_PARALLEL_GROUP[group_name]


def _get_expert_parallel_group_dict() -> dict:
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group_dict() -> dict:
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_broadcast_src_rank(group_name) -> int:
    return int(_EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name][0])


def _get_expert_parallel_world_size(group_name) -> int:
    return _dist().get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name) -> int:
    return _dist().get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name) -> int:
    return _dist().get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name) -> int:
    return _dist().get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_model_parallel_world_size() -> int:
    return 1


def is_invalid_grad_norm(norm) -> bool:
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


class CheckOverflow:
    """Checks for overflow in gradients across parallel processes (DeepSpeed's, see the module docstring)."""

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter=False, deepspeed=None):
        self.mpu, self.zero_reduce_scatter, self.deepspeed = mpu, zero_reduce_scatter, deepspeed
        self.params = [p for g in param_groups for p in g] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or ())

    def check_using_norm(self, norm_group, reduce_overflow=True) -> bool:
        dist = _dist()
        flag = get_accelerator().FloatTensor([float(any(is_invalid_grad_norm(n) for n in norm_group))])
        if self.has_moe_params:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_get_max_expert_parallel_group())
        if self.mpu is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif reduce_overflow:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            dist.barrier()
        return bool(flag[0].item())

    def check(self, param_groups=None) -> bool:
        if param_groups is None:
            return self.has_overflow(self.params, self.has_moe_params)
        params = [p for g in param_groups for p in g]
        return self.has_overflow(params, any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and not bool(torch.isfinite(p.grad.data).all()) for p in params)

    def has_overflow(self, params, has_moe_params=None) -> bool:
        dist = _dist()
        has_moe_params = self.has_moe_params if has_moe_params is None else has_moe_params
        flag = get_accelerator().ByteTensor([int(self.has_overflow_serial(params))])
        if has_moe_params:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_get_max_expert_parallel_group())
        if self.zero_reduce_scatter:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dist.get_world_group())
        elif self.mpu is not None:
            ds = self.deepspeed
            if ds is not None:
                pipe = hasattr(ds, "pipeline_enable_backward_allreduce")
                if (pipe and ds.pipeline_enable_backward_allreduce is False) or \
                        (not pipe and ds.enable_backward_allreduce is False):
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mpu.get_data_parallel_group())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif self.deepspeed is not None and self.deepspeed.enable_backward_allreduce is False:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dist.get_world_group())
        return bool(flag[0].item())


def get_weight_norm(parameters, norm_type=2, mpu=None):
    dist = _dist()
    parameters = [parameters] if torch.is_tensor(parameters) else list(parameters)
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = get_accelerator().FloatTensor([float(max(p.data.abs().max() for p in parameters))])
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
        total = total[0].item()
    else:
        mp_rank = bwc_tensor_model_parallel_rank(mpu)
        total = 0.0
        for p in parameters:
            if getattr(p, "ds_pipe_replicated", False):      # pipeline-replicated: counted once
                continue
            if mp_rank > 0 and not (getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False)):
                continue                                   # tensor-parallel replicas: counted on tp rank 0
            total += p.data.float().norm(norm_type) ** norm_type     # fp32, as DeepSpeed's sum
        t = get_accelerator().FloatTensor([float(total)])
        if mpu is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total = t[0].item() ** (1.0 / norm_type)
    return -1 if not math.isfinite(total) else total


def bwc_tensor_model_parallel_rank(mpu=None) -> int:
    """deepspeed.utils.bwc's: the tensor-parallel rank, by whichever name the mpu answers."""
    if mpu is None:
        return 0
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return mpu.get_tensor_model_parallel_rank()
    if hasattr(mpu, "get_slice_parallel_rank"):
        return mpu.get_slice_parallel_rank()
    return mpu.get_model_parallel_rank()
