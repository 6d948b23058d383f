"""torch.distributed's coalesced calls, built from ringzero's collectives: many tensors, one
collective (primitives/coalesced.py explains why that saves latency).

    import primitives as P
    P.all_reduce_coalesced([w.grad, b.grad], P.ReduceOp.SUM)
    P.all_gather_coalesced(output_tensor_lists, [a, b])    # output_tensor_lists[p][i] <- rank p's i-th

Cost: one all-reduce (or one all-gather) of the concatenated tensors, plus two local copies of
S bytes. The call runs when it is posted; with async_op=True it returns a finished future
(torch returns Work.get_future() here too), so waiting on it never blocks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from primitives.coalesced import all_reduce_coalesced as _textbook_all_reduce_coalesced
from primitives.comm import Work
from primitives.engine.api import all_gather_single, complex_op, outside, reals
from primitives.engine.check import ReduceOp, op_name
from primitives.engine.registry import get_comm


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
