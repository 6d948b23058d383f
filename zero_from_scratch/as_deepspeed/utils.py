"""deepspeed.utils / deepspeed.runtime.utils names the runner writes itself, with DeepSpeed's behaviour.

    import deepspeed                      (under python -m zero_from_scratch.as_deepspeed SCRIPT)
    deepspeed.utils.logger.info("..."); deepspeed.runtime.utils.set_random_seed(42)

logger       logging.getLogger("DeepSpeed") at WARNING, one stdout handler, no propagation, and
             DeepSpeed's format (deepspeed/utils/logging.py::LoggerFactory.create_logger).
set_log_level_from_string(level, custom_logger=None)   the logger's level and its handlers' (deepspeed/utils/logging.py).
_get_expert_parallel_ranks   utils/groups.py's rank lists of expert-parallel and expert-data-parallel groups
             (a pure function: ringzero builds no expert groups from them).
log_dist     logs "[Rank r] message" on the listed ranks (every rank before torch.distributed
             starts; ranks=[-1] means all), as deepspeed/utils/logging.py::log_dist.
see_memory_usage(message, force=False)   with force, on rank 0: gc, then DeepSpeed's three prints
             (the message; MA/Max_MA/CA/Max_CA in GB from the accelerator; the host's virtual
             memory), and the peak counter reset: runtime/utils.py::see_memory_usage.
set_random_seed   random, numpy (seed mod 2^32) and torch (seed mod 2^63): runtime/utils.py.
clone_tensors_for_torch_save   detached clones on `device`, nested lists/tuples/dicts kept
             (deepspeed/checkpoint/utils.py); get_model_ckpt_name_for_rank, its model-states file name.
call_to_str, prefix_sum_inc, required_torch_version, count_used_parameters_in_backward   runtime/utils.py's
             and utils/torch.py's helpers (the last: inside a backward hook, how many of `parameters`
             this backward will reach, by torch's engine query).
clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None)   runtime/utils.py's: the p-norm of the
             gradients (with an mpu: summed over its model-parallel group, replicated weights counted on
             model-parallel rank 0 only), averaged over the data-parallel group (all ranks: ringzero
             has no expert groups), every gradient scaled by min(1, max_norm / (norm + 1e-6)).
Cost: nothing beyond the copies.
"""
from __future__ import annotations

import gc
import logging
import os
import random
import sys

import numpy
import torch
import torch.distributed as dist

from zero_from_scratch.as_deepspeed.accelerator import get_accelerator


def _make_logger() -> logging.Logger:
    log = logging.getLogger("DeepSpeed")
    log.setLevel(logging.WARNING)
    log.propagate = False
    if not any(getattr(h, "_ringzero", False) for h in log.handlers):
        h = logging.StreamHandler(stream=sys.stdout)
        h.setLevel(logging.WARNING)
        h.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                         "%(message)s"))
        h._ringzero = True
        log.addHandler(h)
    return log


logger = _make_logger()
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}


def get_log_level_from_string(log_level_str: str) -> int:
    if log_level_str.lower() not in _LEVELS:
        raise ValueError(f"{log_level_str.lower()} is not one of the valid logging levels. Valid log levels are "
                         f"{_LEVELS.keys()}.")    # DeepSpeed's words
    return _LEVELS[log_level_str.lower()]


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    log = logger if custom_logger is None else custom_logger
    log.setLevel(get_log_level_from_string(log_level_str))
    for h in log.handlers:
        h.setLevel(log.level)


COMM_STARTED: list = []   # non-empty once deepspeed.init_distributed ran here (DeepSpeed's deepspeed.comm.cdb is set)


def _dist_msg(message: str, ranks=None) -> str | None:
    """DeepSpeed's get_dist_msg: its rank test asks deepspeed.comm, which knows of torch.distributed only
    once deepspeed.init_distributed ran; before that every process logs as rank -1."""
    on = bool(COMM_STARTED) and dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if on else -1
    ranks = ranks or []
    if on and not (ranks and (ranks[0] == -1 or me in set(ranks))):
        return None
    return f"[Rank {me}] {message}"


def log_dist(message, ranks=None, level=logging.INFO) -> None:
    msg = _dist_msg(message, ranks)
    if msg is not None:
        logger.log(level, msg)


def see_memory_usage(message, force=False) -> None:
    if not force:
        return
    if dist.is_initialized() and not dist.get_rank() == 0:
        return
    import psutil   # on use: DeepSpeed's dependency, not ringzero's (installed beside DeepSpeed)

    gc.collect()     # as DeepSpeed: collect first so the host numbers are current
    acc, gb = get_accelerator(), 1024**3
    print(message)
    print(f"MA {round(acc.memory_allocated() / gb, 2)} GB \
        Max_MA {round(acc.max_memory_allocated() / gb, 2)} GB \
        CA {round(acc.memory_reserved() / gb, 2)} GB \
        Max_CA {round(acc.max_memory_reserved() / gb)} GB ")
    vm_stats = psutil.virtual_memory()
    print(f'CPU Virtual Memory:  used = {round((vm_stats.total - vm_stats.available) / gb, 2)} GB, '
          f'percent = {vm_stats.percent}%')
    acc.reset_peak_memory_stats()


def set_random_seed(seed: int) -> None:
    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    if torch.is_tensor(item):
        device = torch.device(device) if isinstance(device, str) else device
        return item.detach().clone() if device == item.device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def call_to_str(base, *args, **kwargs) -> str:
    """'base(arg, key=value)' with repr() of each argument."""
    return f"{base}({', '.join([repr(a) for a in args] + [f'{k}={v!r}' for k, v in kwargs.items()])})"


def prefix_sum_inc(weights) -> list:
    """The inclusive prefix sum: [3, 4, 5] → [3, 7, 12]."""
    out = list(weights)
    for i in range(1, len(out)):
        out[i] += out[i - 1]
    return out


def required_torch_version(min_version=None, max_version=None) -> bool:
    """True when torch's version lies in [min_version, max_version] (either bound optional, one required)."""
    from packaging import version   # DeepSpeed's dependency (and torch's)
    assert min_version or max_version, "Must provide a min_version or max_version argument"
    v = version.parse(torch.__version__)
    return not ((min_version and version.parse(str(min_version)) > v) or
                (max_version and version.parse(str(max_version)) < v))


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    parameters = [p for p in ([parameters] if torch.is_tensor(parameters) else parameters) if p.grad is not None]
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        total = torch.stack([p.grad.detach().abs().max().float() for p in parameters]).max()
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        counted = [p for p in parameters if mpu is None or mpu.get_model_parallel_rank() == 0 or
                   getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False)]
        norms = [p.grad.detach().float().norm(norm_type) for p in counted]
        total = torch.stack(norms).pow(norm_type).sum().float() if norms else torch.zeros(1)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    total = total * 1.0 / float(dist.get_world_size())   # DeepSpeed averages over its data-parallel group
    dist.all_reduce(total)
    total = total.to(parameters[0].device)
    coef = torch.min(torch.tensor([1.0]), torch.tensor([float(max_norm)]) / (total + 1e-6))
    for p in parameters:
        p.grad.data.mul_(coef)
    return total


def count_used_parameters_in_backward(parameters) -> int:
    from torch.autograd.graph import _get_grad_fn_or_grad_acc     # torch internals, as DeepSpeed's
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    nodes = set()
    for p in parameters:
        if isinstance(p, torch.Tensor) and p.requires_grad:
            with torch.enable_grad():      # hooks run with grad off; the lookup for a leaf needs it on
                node = _get_grad_fn_or_grad_acc(p)
            if node is not None:
                nodes.add(node)
    return int(sum(map(torch._C._will_engine_execute_node, nodes)))


def _get_expert_parallel_ranks(world_size, tensor_parallel_size_, expert_parallel_size_, pipeline_parallel_size_=1,
                               use_data_before_expert_parallel_=False):
    """DeepSpeed's (utils/groups.py): (expert-parallel groups, expert-data-parallel groups) as rank lists,
    each pipeline stage's data-parallel groups cut into runs of expert_parallel_size_ (E + D), or
    strided first (D + E with use_data_before_expert_parallel_)."""
    tp, pp, ep = tensor_parallel_size_, pipeline_parallel_size_, expert_parallel_size_
    assert world_size % (tp * pp) == 0, f"{world_size} is not divisible by {tp * pp}"
    dp_world_size = world_size // (tp * pp)
    assert dp_world_size % ep == 0, f"{dp_world_size} is not divisible by {ep}"
    pp_stride = world_size // pp
    dp_groups = []
    for start in range(0, world_size, pp_stride):
        for i in range(tp):
            if use_data_before_expert_parallel_:
                dp_stride = world_size // ep // tp // pp
                dp_groups.append([r for ds in range(dp_stride)
                                  for r in range(start + i + ds * tp, start + pp_stride, dp_stride * tp)])
            else:
                dp_groups.append(list(range(start + i, start + pp_stride, tp)))
    ep_groups, edp_groups = [], []
    for ranks in dp_groups:
        part = [ranks[i:i + ep] for i in range(0, dp_world_size, ep)]
        ep_groups.extend(part)
        edp_groups.extend(list(r) for r in zip(*part))
    return ep_groups, edp_groups
