"""deepspeed.comm served by ringzero: torch.distributed's shape, the collectives from primitives.

    import deepspeed.comm as dist          (under python -m zero_from_scratch.as_deepspeed SCRIPT)
    dist.init_distributed(); dist.all_reduce(t); dist.barrier(); dist.get_rank()

The collectives (all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor, allgather_fn, reduce_scatter,
reduce_scatter_tensor, reduce_scatter_fn, gather, scatter, all_to_all_single, all_to_all, barrier) run ringzero's
algorithms built from send/recv (primitives/engine/api.py), in torch's in-place semantics and
with DeepSpeed's signatures (deepspeed/comm/comm.py).
Under the runner the ZeRO engine's own collectives call these names (engine/comm.py call_through), so a
script that patches dist.all_reduce / reduce_scatter_fn / all_gather_into_tensor sees them, as with DeepSpeed.
Point-to-point (send, recv, isend, irecv, batch_isend_irecv), the object collectives and the group
bookkeeping are torch.distributed's own: primitives is built on them. DeepSpeed's comms profiling
(prof=True, log_summary) is not served: ringzero's ledger is primitives.LEDGER.
Cost: each collective's, see primitives/engine/api.py; barrier is a one-element all-reduce.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import primitives
from zero_from_scratch.as_deepspeed.finder import NotServedError, message
from zero_from_scratch.as_deepspeed.top import init_distributed
from zero_from_scratch.as_deepspeed.comm_names import ENGINE_CALL   # the engine's algorithm and tag, if its call

ReduceOp = dist.ReduceOp
P2POp = dist.P2POp
send, recv, isend, irecv, batch_isend_irecv = dist.send, dist.recv, dist.isend, dist.irecv, dist.batch_isend_irecv
broadcast_object_list, all_gather_object = dist.broadcast_object_list, dist.all_gather_object
new_group, get_global_rank = dist.new_group, dist.get_global_rank
destroy_process_group = dist.destroy_process_group

__all__ = ["ReduceOp", "P2POp", "init_distributed", "is_initialized", "is_available", "destroy_process_group",
           "new_group", "inference_all_reduce", "get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_world_group",
           "get_all_ranks_from_group", "barrier", "all_reduce", "broadcast", "reduce", "all_gather",
           "all_gather_into_tensor", "allgather_fn", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn",
           "gather", "scatter",
           "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv", "batch_isend_irecv",
           "broadcast_object_list", "all_gather_object", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
           "log_summary"]


def _no_prof(prof: bool, name: str) -> None:
    if prof:
        raise NotServedError(message(f"deepspeed.comm.{name}(prof=True)", "time the call into its comms logger",
                                     "primitives.LEDGER and engine.comm_report()"))


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return True


def _started(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"deepspeed.comm.{what}: DeepSpeed backend not set, please initialize it using "
                           "deepspeed.init_distributed()")


def get_rank(group=None) -> int:
    _started("get_rank")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    _started("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """LOCAL_RANK (set by torchrun and deepspeed), else OMPI_COMM_WORLD_LOCAL_RANK, else 0 (comm/utils.py)."""
    _started("get_local_rank")
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_world_group():
    return dist.group.WORLD


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    _no_prof(prof, "barrier")
    cuda = dist.get_backend(group) == "nccl"
    flag = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
    return primitives.all_reduce(flag, ReduceOp.SUM, group, async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    _no_prof(prof, "all_reduce")
    return primitives.all_reduce(tensor, op, group, async_op, **ENGINE_CALL.get())


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce",
                         debug=None):
    """DeepSpeed's latency-tuned all-reduce for inference (shared memory on CPU): here the same all_reduce,
    done before it returns (DeepSpeed's is synchronous too)."""
    _no_prof(prof, "all_reduce")
    return primitives.all_reduce(tensor, op, group)


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    _no_prof(prof, "broadcast")
    return primitives.broadcast(tensor, src, group, async_op, **ENGINE_CALL.get())


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    _no_prof(prof, "reduce")
    return primitives.reduce(tensor, dst, op, group, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    _no_prof(prof, "all_gather")
    return primitives.all_gather(tensor_list, tensor, group, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    _no_prof(prof, "all_gather_into_tensor")
    return primitives.all_gather_single(output_tensor, input_tensor, group, async_op, **ENGINE_CALL.get())


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's (comm.py): the call its ZeRO-3 parameter gathers make, an all_gather_into_tensor that a
    patch of `deepspeed.comm.all_gather_into_tensor` does not see (DeepSpeed's calls its own module's)."""
    _started("allgather_fn")
    return primitives.all_gather_single(output_tensor, input_tensor, group, async_op, **ENGINE_CALL.get())


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):
    _no_prof(prof, "reduce_scatter")
    return primitives.reduce_scatter(output, input_list, op, group, async_op, **ENGINE_CALL.get())


def reduce_scatter_tensor(output_tensor, input_tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                          log_name="reduce_scatter_tensor", debug=None):
    _no_prof(prof, "reduce_scatter_tensor")
    return primitives.reduce_scatter_single(output_tensor, input_tensor, op, group, async_op, **ENGINE_CALL.get())


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    """DeepSpeed's: reduce_scatter_tensor (the flat input cut into world-size blocks), its only path here.
    DeepSpeed's ZeRO-3 reduces each gradient bucket through it; under the runner so does ringzero's engine
    at every stage (its gradient reduce-scatter per unit; engine/comm.py call_through)."""
    _started("reduce_scatter_fn")
    return reduce_scatter_tensor(output_tensor, tensor, op, group, async_op, prof)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    _no_prof(prof, "gather")
    return primitives.gather(tensor, gather_list, dst, group, async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter", debug=None):
    _no_prof(prof, "scatter")
    return primitives.scatter(tensor, scatter_list, src, group, async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      prof=False, log_name="all_to_all_single", debug=None):
    _no_prof(prof, "all_to_all_single")
    return primitives.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group, async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, prof=False, log_name="all_to_all",
               debug=None):
    _no_prof(prof, "all_to_all")
    return primitives.all_to_all(output_tensor_list, input_tensor_list, group, async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def log_summary(*args, **kwargs):
    raise NotServedError(message("deepspeed.comm.log_summary", "print its comms logger's per-op table",
                                 "primitives.LEDGER and engine.comm_report()"))
