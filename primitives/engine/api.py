"""The drop-in for torch.distributed: torch's signatures (positional and keyword names,
group_src/group_dst, async_op), same in-place semantics, plus a keyword-only `algorithm=`
(ALGORITHMS; "auto" picks by the α-β cost model) and `tag=`.

    import primitives as P
    P.all_reduce(t, P.ReduceOp.SUM, group=None, async_op=False, algorithm="ring", tag=0)

Each function resolves `group` to its communicator (get_comm: shared memory on one host, gloo's
TCP, nccl, or MPI) and runs the checked call (calls/), which runs the textbook algorithm. As in
torch: a rank outside `group` gets a warning and None; async_op=True returns a Work (the one
handle type, primitives/comm.py: wait(timeout=), get_future(), exception(); wait(timeout) polls
every 0.5 ms, get_future() completes from the communicator's worker thread); ReduceOp.BAND/BOR/BXOR
reduce integer and bool tensors. Complex tensors travel as their real view (torch.view_as_real: a
trailing dim of 2), like torch.distributed does: every collective moves them; the reducing ones
accept SUM and AVG, which act on real and imaginary parts separately (torch's supports_complex
refuses the rest). The *_coalesced calls: below; the *_object calls: objects.py.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from primitives.coalesced import all_reduce_coalesced as _textbook_all_reduce_coalesced
from primitives.comm import Communicator, Work
from primitives.engine.algos import ALGORITHMS
from primitives.engine.calls import all_gather as _ag
from primitives.engine.calls import all_reduce as _ar
from primitives.engine.calls import all_to_all as _a2a
from primitives.engine.calls import rooted as _rooted
from primitives.engine.check import ReduceOp, op_name
from primitives.engine.cost import SHM_NATIVE
from primitives.engine.registry import _COMMS, get_comm


COMPLEX_OPS = ("sum", "avg")


def outside(group, name: str, stacklevel: int = 3) -> bool:
    """True, after torch's warning, when this process is not in `group` (torch then returns None
    without communicating)."""
    if group is None or isinstance(group, Communicator) or not dist.is_initialized():
        return False
    if group is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(group, dist.ProcessGroup)
                                                      and dist.get_rank(group) < 0):
        warnings.warn(f"Running {name} on global rank {dist.get_rank()} which does not belong to the given group.",
                      stacklevel=stacklevel)
        return True
    return False


def real(t):
    """A complex tensor's real view (trailing dim of 2); anything else unchanged."""
    return torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() else t


def reals(ts):
    return [real(t) for t in ts] if isinstance(ts, (list, tuple)) else ts


def complex_op(name: str, op, tensors, op_name, torch_name: str | None = None) -> None:
    """torch's rule: a reducing call on complex tensors takes SUM or AVG only (torch_name: the
    call torch's message names, e.g. all_reduce for all_reduce_coalesced)."""
    flat = [x for t in tensors for x in (t if isinstance(t, (list, tuple)) else [t])]
    if any(isinstance(t, torch.Tensor) and t.is_complex() for t in flat) and op_name(op) not in COMPLEX_OPS:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"rank {rank}: {torch_name or name} does not support {op} on complex tensors "
                         f"(in {name}: SUM and AVG act on real and imaginary parts; the others are not defined)")


def work(result, outputs, name: str, async_op: bool):
    """The engine call's result as torch returns it: None for a blocking call, else its Work
    (primitives/comm.py), holding the tensors it writes (result(), get_future())."""
    if not async_op:
        return None
    result = result if result is not None else Work(None, None, None, name)
    result.outputs = outputs
    return result


def _run(name: str, group, async_op: bool, outputs, call, op=None, reduced=()):
    """torch's conventions around the checked call `call(comm)`: None (after torch's warning)
    on a rank outside `group`; complex tensors (`reduced`) only with SUM or AVG; an async call's
    Work holding `outputs`."""
    if outside(group, name, stacklevel=4):
        return None
    if op is not None:
        complex_op(name, op, reduced, op_name)
    return work(call(get_comm(group)), outputs, name, async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_reduce(tensor, op): in place on every rank. A blocking call of a
    planned signature replays its plan (planned.py) without the steps below."""
    if not async_op:
        comm = group if isinstance(group, Communicator) else (
            _COMMS.get(group if group is None else id(group)) if dist.is_initialized() else None)
        pl = comm.__dict__.get("planned") if comm is not None and (group is None or comm is group
                                                                   or comm.group is group) else None
        if pl and (pl := pl.get((tensor.dtype, tensor.shape, id(op), algorithm, tag))) is not None and pl.run(tensor):
            return None
    return _run("all_reduce", group, async_op, [tensor], lambda comm: _ar.all_reduce(
        comm, real(tensor), op, async_op, algorithm=algorithm, tag=tag), op, [tensor])


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *, algorithm="auto", tag=0):
    """Like torch.distributed.broadcast: tensor on every rank becomes the root's tensor; the root
    is `src` (a global rank) or `group_src` (a rank of the group)."""
    return _run("broadcast", group, async_op, [tensor], lambda comm: _rooted.broadcast(
        comm, real(tensor), src, async_op, group_src=group_src, algorithm=algorithm, tag=tag))


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None, *, algorithm="auto",
           tag=0):
    """Like torch.distributed.reduce(tensor, dst, op): the result lands in the root's tensor
    (`dst` a global rank, or `group_dst` a rank of the group)."""
    op = ReduceOp.SUM if op is None else op
    return _run("reduce", group, async_op, [tensor], lambda comm: _rooted.reduce(
        comm, real(tensor), dst, op, async_op, group_dst=group_dst, algorithm=algorithm, tag=tag), op, [tensor])


def all_gather(tensor_list, tensor, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather(tensor_list, tensor): tensor_list[i] <- rank i's tensor."""
    return _run("all_gather", group, async_op, tensor_list, lambda comm: _ag.all_gather(
        comm, reals(tensor_list), real(tensor), async_op, algorithm=algorithm, tag=tag))


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather_single: output_tensor (N·numel elements) <- all inputs, rank-major."""
    return _run("all_gather_single", group, async_op, [output_tensor], lambda comm: _ag.all_gather_single(
        comm, real(output_tensor), real(input_tensor), async_op, algorithm=algorithm, tag=tag))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter(output, input_list, op); the blocks of input_list
    may differ in size (block p the size of rank p's output), as on gloo."""
    return _run("reduce_scatter", group, async_op, [output], lambda comm: _ag.reduce_scatter(
        comm, real(output), reals(input_list), op, async_op, algorithm=algorithm, tag=tag), op, [output, input_list])


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter_single: input holds N blocks of output.numel() elements."""
    return _run("reduce_scatter_single", group, async_op, [output], lambda comm: _ag.reduce_scatter_single(
        comm, real(output), real(input), op, async_op, algorithm=algorithm, tag=tag), op, [output, input])


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None, *, algorithm="auto",
            tag=0):
    """Like torch.distributed.scatter(tensor, scatter_list, src); scatter_list is read on the root
    only (`src` a global rank or `group_src` a group rank; neither given: global rank 0)."""
    src = 0 if src is None and group_src is None else src
    return _run("scatter", group, async_op, [tensor], lambda comm: _rooted.scatter(
        comm, real(tensor), reals(scatter_list) or None, src, async_op, group_src=group_src, algorithm=algorithm,
        tag=tag))


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None, *, algorithm="auto",
           tag=0):
    """Like torch.distributed.gather(tensor, gather_list, dst); gather_list is written on the root
    only (`dst` a global rank or `group_dst` a group rank; neither given: global rank 0)."""
    dst = 0 if dst is None and group_dst is None else dst
    return _run("gather", group, async_op, gather_list or [], lambda comm: _rooted.gather(
        comm, real(tensor), reals(gather_list) or None, dst, async_op, group_dst=group_dst, algorithm=algorithm,
        tag=tag))


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all_single: rows input_split_sizes[p] of `input` go to rank p;
    output_split_sizes[p] rows of `output` come from rank p (None = dim 0 split evenly)."""
    return _run("all_to_all_single", group, async_op, [output], lambda comm: _a2a.all_to_all_single(
        comm, real(output), real(input), output_split_sizes, input_split_sizes, async_op, algorithm=algorithm,
        tag=tag))


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all: output_tensor_list[p] <- rank p's input_tensor_list[me]."""
    return _run("all_to_all", group, async_op, output_tensor_list, lambda comm: _a2a.all_to_all(
        comm, reals(output_tensor_list), reals(input_tensor_list), async_op, algorithm=algorithm, tag=tag))


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


# ----------------------------------------------------------------------------- coalesced calls
# Many tensors, one collective (primitives/coalesced.py explains why that saves latency). Cost: one
# all-reduce (or one all-gather) of the concatenated tensors, plus two local copies of S bytes. The
# call runs when it is posted; with async_op=True it returns a finished future (torch returns
# Work.get_future() here too), so waiting on it never blocks.

def _tensors(name: str, arg: str, lst) -> list:
    """torch's checks: a list of tensors of one dtype (a complex dtype may mix with its real type)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(lst, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in lst):
        raise TypeError(f"rank {rank}: {name}: argument {arg!r} must be a list of tensors, got {type(lst).__name__}")
    kinds = {torch.view_as_real(t).dtype if t.is_complex() else t.dtype for t in lst}
    if len(kinds) > 1:
        raise ValueError(f"rank {rank}: {name}: argument {arg!r} mixes dtypes {sorted(map(str, kinds))}; "
                         f"one flat buffer needs one dtype")
    return list(lst)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    """Like torch.distributed.all_reduce_coalesced: every tensor all-reduced in place, through
    one flat buffer and one checked all-reduce (the textbook's primitives/coalesced.py)."""
    if outside(group, "all_reduce_coalesced"):
        return None
    tensors = _tensors("all_reduce_coalesced", "tensors", tensors)
    complex_op("all_reduce_coalesced", op, tensors, op_name, torch_name="all_reduce")
    _textbook_all_reduce_coalesced(get_comm(group), reals(tensors), op)
    return Work(None, None, None, "all_reduce_coalesced", tensors).get_future() if async_op else None


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op=False):
    """Like torch.distributed.all_gather_coalesced: output_tensor_lists[p][i] <- rank p's
    input_tensor_list[i], through one all_gather_single of the concatenated inputs."""
    if outside(group, "all_gather_coalesced"):
        return None
    name = "all_gather_coalesced"
    ins = reals(_tensors(name, "input_tensor_list", input_tensor_list))
    if not isinstance(output_tensor_lists, list):
        raise TypeError(f"rank {dist.get_rank()}: {name}: argument 'output_tensor_lists' should be a list")
    outs = [reals(_tensors(name, "output_tensor_lists", lst)) for lst in output_tensor_lists]
    n = get_comm(group).size
    if len(outs) != n or any(len(o) != len(ins) or [t.numel() for t in o] != [t.numel() for t in ins] for o in outs):
        raise ValueError(f"rank {dist.get_rank()}: {name}: argument 'output_tensor_lists' must hold {n} lists "
                         f"shaped like input_tensor_list ({[tuple(t.shape) for t in ins]})")
    dtype = ins[0].dtype if ins else torch.float32
    flat = torch.cat([t.reshape(-1) for t in ins]) if ins else torch.empty(0, dtype=dtype)
    gathered = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_single(gathered, flat, group)
    for p, row in enumerate(gathered.view(n, -1) if flat.numel() else [gathered] * n):
        off = 0
        for t in outs[p]:
            t.copy_(row[off:off + t.numel()].view_as(t))
            off += t.numel()
    return Work(None, None, None, name, output_tensor_lists).get_future() if async_op else None
