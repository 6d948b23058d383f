"""torch.distributed's conventions around the checked calls (api.py): the Work an async call
returns (primitives/comm.py's, the one handle type), ranks outside the group, and complex tensors.

    work = primitives.all_reduce(t, async_op=True)
    work.wait(timeout=timedelta(seconds=5)); work.get_future().wait(); work.exception()

Cost: nothing on the data path. Work.wait(timeout) polls the call's completion every 0.5 ms;
get_future() completes from the communicator's worker thread when the call ends.

Complex tensors travel as their real view (torch.view_as_real: a trailing dim of 2), like
torch.distributed does: every collective moves them; the reducing ones accept SUM and AVG,
which act on real and imaginary parts separately (torch's supports_complex refuses the rest).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from primitives.comm import Communicator, Work

COMPLEX_OPS = ("sum", "avg")


def outside(group, name: str) -> bool:
    """True, after torch's warning, when this process is not in `group` (torch then returns None
    without communicating)."""
    if group is None or isinstance(group, Communicator) or not dist.is_initialized():
        return False
    if group is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(group, dist.ProcessGroup)
                                                      and dist.get_rank(group) < 0):
        warnings.warn(f"Running {name} on global rank {dist.get_rank()} which does not belong to the given group.",
                      stacklevel=3)
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
