"""The drop-in for torch.distributed: same positional arguments, same in-place semantics, plus a
keyword-only `algorithm=` (ALGORITHMS; "auto" picks by the α-β cost model) and `tag=`.

    import primitives as P
    P.all_reduce(t, P.ReduceOp.SUM, group=None, async_op=False, algorithm="ring", tag=0)

Each function resolves `group` to its communicator (get_comm: shared memory on one host, gloo's
TCP, nccl, or MPI) and runs the checked call (calls/), which runs the textbook algorithm.
"""
from __future__ import annotations

from primitives.engine.algos import ALGORITHMS
from primitives.engine.calls import all_gather as _ag
from primitives.engine.calls import all_reduce as _ar
from primitives.engine.calls import all_to_all as _a2a
from primitives.engine.calls import broadcast as _bc
from primitives.engine.calls import gather as _ga
from primitives.engine.calls import reduce as _re
from primitives.engine.calls import reduce_scatter as _rs
from primitives.engine.calls import scatter as _sc
from primitives.engine.check import ReduceOp
from primitives.engine.cost import SHM_NATIVE
from primitives.engine.registry import get_comm


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_reduce(tensor, op): in place on every rank."""
    return _ar.all_reduce(get_comm(group), tensor, op, async_op, algorithm=algorithm, tag=tag)


def broadcast(tensor, src, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.broadcast: tensor on every rank becomes src's tensor (src is a global rank)."""
    return _bc.broadcast(get_comm(group), tensor, src, async_op, algorithm=algorithm, tag=tag)


def reduce(tensor, dst, op=None, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce(tensor, dst, op): the result lands in dst's tensor."""
    return _re.reduce(get_comm(group), tensor, dst, op, async_op, algorithm=algorithm, tag=tag)


def all_gather(tensor_list, tensor, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather(tensor_list, tensor): tensor_list[i] <- rank i's tensor."""
    return _ag.all_gather(get_comm(group), tensor_list, tensor, async_op, algorithm=algorithm, tag=tag)


def all_gather_single(output, input, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather_single: output (N·numel elements) <- all inputs, rank-major."""
    return _ag.all_gather_single(get_comm(group), output, input, async_op, algorithm=algorithm, tag=tag)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter(output, input_list, op)."""
    return _rs.reduce_scatter(get_comm(group), output, input_list, op, async_op, algorithm=algorithm, tag=tag)


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter_single: input holds N blocks of output.numel() elements."""
    return _rs.reduce_scatter_single(get_comm(group), output, input, op, async_op, algorithm=algorithm, tag=tag)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.scatter(tensor, scatter_list, src); scatter_list is read on src only."""
    return _sc.scatter(get_comm(group), tensor, scatter_list, src, async_op, algorithm=algorithm, tag=tag)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.gather(tensor, gather_list, dst); gather_list is written on dst only."""
    return _ga.gather(get_comm(group), tensor, gather_list, dst, async_op, algorithm=algorithm, tag=tag)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all_single: rows input_split_sizes[p] of `input` go to rank p;
    output_split_sizes[p] rows of `output` come from rank p (None = dim 0 split evenly)."""
    return _a2a.all_to_all_single(get_comm(group), output, input, output_split_sizes, input_split_sizes,
                                  async_op, algorithm=algorithm, tag=tag)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all: output_tensor_list[p] <- rank p's input_tensor_list[me]."""
    return _a2a.all_to_all(get_comm(group), output_tensor_list, input_tensor_list, async_op,
                           algorithm=algorithm, tag=tag)


def algorithms_for(name: str, comm) -> list[str]:
    """ALGORITHMS[name], plus "shm" when every rank of comm shares this host's memory (shm.py)."""
    return ALGORITHMS[name] + (["shm"] if getattr(comm, "transport", None) == "shm" and name in SHM_NATIVE else [])
