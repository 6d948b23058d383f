"""The drop-in for torch.distributed: torch's signatures (positional and keyword names,
group_src/group_dst, async_op), same in-place semantics, plus a keyword-only `algorithm=`
(ALGORITHMS; "auto" picks by the α-β cost model) and `tag=`.

    import primitives as P
    P.all_reduce(t, P.ReduceOp.SUM, group=None, async_op=False, algorithm="ring", tag=0)

Each function resolves `group` to its communicator (get_comm: shared memory on one host, gloo's
TCP, nccl, or MPI) and runs the checked call (calls/), which runs the textbook algorithm. As in
torch: a rank outside `group` gets a warning and None; async_op=True returns a Work (compat.py);
complex tensors move as their real view and reduce with SUM/AVG; ReduceOp.BAND/BOR/BXOR reduce
integer and bool tensors. The *_coalesced and *_object calls: coalesced.py, objects.py.
"""
from __future__ import annotations

import warnings

from primitives.engine.algos import ALGORITHMS
from primitives.engine.calls import all_gather as _ag
from primitives.engine.calls import all_reduce as _ar
from primitives.engine.calls import all_to_all as _a2a
from primitives.engine.calls import broadcast as _bc
from primitives.engine.calls import gather as _ga
from primitives.engine.calls import reduce as _re
from primitives.engine.calls import reduce_scatter as _rs
from primitives.engine.calls import scatter as _sc
from primitives.engine.check import ReduceOp, op_name
from primitives.engine.compat import complex_op, outside, real, reals, work
from primitives.engine.cost import SHM_NATIVE
from primitives.engine.registry import get_comm


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_reduce(tensor, op): in place on every rank."""
    if outside(group, "all_reduce"):
        return None
    complex_op("all_reduce", op, [tensor], op_name)
    r = _ar.all_reduce(get_comm(group), real(tensor), op, async_op, algorithm=algorithm, tag=tag)
    return work(r, [tensor], "all_reduce", async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *, algorithm="auto", tag=0):
    """Like torch.distributed.broadcast: tensor on every rank becomes the root's tensor; the root
    is `src` (a global rank) or `group_src` (a rank of the group)."""
    if outside(group, "broadcast"):
        return None
    r = _bc.broadcast(get_comm(group), real(tensor), src, async_op, group_src=group_src, algorithm=algorithm, tag=tag)
    return work(r, [tensor], "broadcast", async_op)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None, *, algorithm="auto",
           tag=0):
    """Like torch.distributed.reduce(tensor, dst, op): the result lands in the root's tensor
    (`dst` a global rank, or `group_dst` a rank of the group)."""
    if outside(group, "reduce"):
        return None
    op = ReduceOp.SUM if op is None else op
    complex_op("reduce", op, [tensor], op_name)
    r = _re.reduce(get_comm(group), real(tensor), dst, op, async_op, group_dst=group_dst, algorithm=algorithm,
                   tag=tag)
    return work(r, [tensor], "reduce", async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather(tensor_list, tensor): tensor_list[i] <- rank i's tensor."""
    if outside(group, "all_gather"):
        return None
    r = _ag.all_gather(get_comm(group), reals(tensor_list), real(tensor), async_op, algorithm=algorithm, tag=tag)
    return work(r, tensor_list, "all_gather", async_op)


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather_single: output_tensor (N·numel elements) <- all inputs, rank-major."""
    if outside(group, "all_gather_single"):
        return None
    r = _ag.all_gather_single(get_comm(group), real(output_tensor), real(input_tensor), async_op,
                              algorithm=algorithm, tag=tag)
    return work(r, [output_tensor], "all_gather_single", async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter(output, input_list, op); the blocks of input_list
    may differ in size (block p the size of rank p's output), as on gloo."""
    if outside(group, "reduce_scatter"):
        return None
    complex_op("reduce_scatter", op, [output, input_list], op_name)
    r = _rs.reduce_scatter(get_comm(group), real(output), reals(input_list), op, async_op, algorithm=algorithm,
                           tag=tag)
    return work(r, [output], "reduce_scatter", async_op)


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter_single: input holds N blocks of output.numel() elements."""
    if outside(group, "reduce_scatter_single"):
        return None
    complex_op("reduce_scatter_single", op, [output, input], op_name)
    r = _rs.reduce_scatter_single(get_comm(group), real(output), real(input), op, async_op, algorithm=algorithm,
                                  tag=tag)
    return work(r, [output], "reduce_scatter_single", async_op)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None, *, algorithm="auto",
            tag=0):
    """Like torch.distributed.scatter(tensor, scatter_list, src); scatter_list is read on the root
    only (`src` a global rank or `group_src` a group rank; neither given: global rank 0)."""
    if outside(group, "scatter"):
        return None
    src = 0 if src is None and group_src is None else src
    r = _sc.scatter(get_comm(group), real(tensor), reals(scatter_list) or None, src, async_op, group_src=group_src,
                    algorithm=algorithm, tag=tag)
    return work(r, [tensor], "scatter", async_op)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None, *, algorithm="auto",
           tag=0):
    """Like torch.distributed.gather(tensor, gather_list, dst); gather_list is written on the root
    only (`dst` a global rank or `group_dst` a group rank; neither given: global rank 0)."""
    if outside(group, "gather"):
        return None
    dst = 0 if dst is None and group_dst is None else dst
    r = _ga.gather(get_comm(group), real(tensor), reals(gather_list) or None, dst, async_op, group_dst=group_dst,
                   algorithm=algorithm, tag=tag)
    return work(r, gather_list or [], "gather", async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all_single: rows input_split_sizes[p] of `input` go to rank p;
    output_split_sizes[p] rows of `output` come from rank p (None = dim 0 split evenly)."""
    if outside(group, "all_to_all_single"):
        return None
    r = _a2a.all_to_all_single(get_comm(group), real(output), real(input), output_split_sizes, input_split_sizes,
                               async_op, algorithm=algorithm, tag=tag)
    return work(r, [output], "all_to_all_single", async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all: output_tensor_list[p] <- rank p's input_tensor_list[me]."""
    if outside(group, "all_to_all"):
        return None
    r = _a2a.all_to_all(get_comm(group), reals(output_tensor_list), reals(input_tensor_list), async_op,
                        algorithm=algorithm, tag=tag)
    return work(r, output_tensor_list, "all_to_all", async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, **kw):
    """torch's deprecated name for all_gather_single (kept so callers of torch < 2.13 run)."""
    warnings.warn("`all_gather_into_tensor` is deprecated (as in torch 2.13): use `all_gather_single`",
                  FutureWarning, stacklevel=2)
    return all_gather_single(output_tensor, input_tensor, group, async_op, **kw)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, **kw):
    """torch's deprecated name for reduce_scatter_single."""
    warnings.warn("`reduce_scatter_tensor` is deprecated (as in torch 2.13): use `reduce_scatter_single`",
                  FutureWarning, stacklevel=2)
    return reduce_scatter_single(output, input, op, group, async_op, **kw)


def algorithms_for(name: str, comm) -> list[str]:
    """ALGORITHMS[name], plus "shm" when every rank of comm shares this host's memory (shm.py)."""
    return ALGORITHMS[name] + (["shm"] if getattr(comm, "transport", None) == "shm" and name in SHM_NATIVE else [])
