"""The engine's communicators: the checked Communicator (checked.py) plus collective methods
that run the checked call (primitives/engine/calls/), so the textbook layers above (DDP, ZeRO,
tensor parallelism) get the argument check, the ledger and "auto" by being handed get_comm(group).

    comm.all_reduce(t, "sum", algorithm="ring", tag=7, async_op=True)

Ranks are the communicator's group ranks; op is "sum" | "avg" | "min" | "max" | "product".
"""
from __future__ import annotations

import torch.distributed as dist

from primitives import comm as textbook
from primitives.engine.calls.all_gather import all_gather, all_gather_single, reduce_scatter, reduce_scatter_single
from primitives.engine.calls.all_reduce import all_reduce
from primitives.engine.calls.all_to_all import all_to_all_single
from primitives.engine.calls.rooted import broadcast
from primitives.engine.checked import DEFAULT_TIMEOUT, NOT_INIT_MSG, CheckedComm, check_member
from primitives.engine.errors import NotInitializedError
from primitives.engine.subcomm import SubComm, split


class Collectives(CheckedComm):
    """The collective methods, through the checked call; keywords algorithm=, tag=, async_op=.
    The checked calls (calls/) take the communicator first, so they are the methods as they are."""
    all_reduce, all_gather, all_gather_single = all_reduce, all_gather, all_gather_single
    reduce_scatter, reduce_scatter_single, all_to_all_single = reduce_scatter, reduce_scatter_single, all_to_all_single

    def broadcast(self, tensor, src, **kw):
        """src: a rank of this communicator (the checked call takes a global rank, as torch's)."""
        return broadcast(self, tensor, self.global_rank(src), **kw)

    def intra_node(self) -> SubComm:
        """The ranks of this communicator on this rank's node (topology.py)."""
        return split(self)[0]

    def inter_node(self) -> SubComm:
        """One rank per node: those with this rank's local index."""
        return split(self)[1]


class CheckedTorchComm(Collectives, textbook.TorchComm):
    """The checked torch.distributed communicator (gloo or nccl), optionally inside a subgroup."""

    def __init__(self, group=None, timeout: float | None = None):
        if not dist.is_initialized():
            raise NotInitializedError(NOT_INIT_MSG)
        check_member(group)
        textbook.TorchComm.__init__(self, group, DEFAULT_TIMEOUT if timeout is None else timeout)
        self.builtin = dist                      # the backend's own collectives: references only
