"""The chapter wrappers as a user calls them: a process group instead of a communicator, the
same starting point on every rank, and (bucketed) torch's own all-reduce as an alternative.

    torchrun --standalone --nproc_per_node 2 ddp_examples/04_bucketed.py --bucket-cap-mb 0.004

Each class is the textbook class of the same name (naive.py, flat.py, bucketed.py) plus: group (a
torch process group, None: the default one or MPI's world; its communicator is get_comm(group)),
init_sync ("broadcast" rank 0's parameters and buffers as torch DDP, "check": raise if any differ,
"none": state.py) and, for BucketedDataParallel, comm_impl ("primitives": ringzero's all-reduce,
counted by the ledger; "torch": the backend's own all_reduce in the same buckets, not on MPI).
A parameter may belong to one live BucketedDataParallel only (a second would send twice).
Cost added: the construction's broadcast (state.py).
"""
from __future__ import annotations

import weakref

import torch.distributed as dist
import torch.nn as nn

from ddp_examples import bucketed, flat, naive
from ddp_examples.engine.state import sync_initial_state
from primitives.engine.registry import get_comm


def _synced_comm(module: nn.Module, group, init_sync: str, who: str):
    """The group's communicator, once every rank holds rank 0's parameters and buffers (state.py)."""
    comm = get_comm(group)
    sync_initial_state(module, comm, init_sync, who, group)
    return comm


class NaiveDataParallel(naive.NaiveDataParallel):
    def __init__(self, module: nn.Module, group=None, *, algorithm: str = "ring", init_sync: str = "broadcast"):
        super().__init__(module, _synced_comm(module, group, init_sync, "NaiveDataParallel"), algorithm=algorithm)
        self.group = group


class FlatDataParallel(flat.FlatDataParallel):
    def __init__(self, module: nn.Module, group=None, *, algorithm: str = "ring", init_sync: str = "broadcast"):
        super().__init__(module, _synced_comm(module, group, init_sync, "FlatDataParallel"), algorithm=algorithm)
        self.group = group


class BucketedDataParallel(bucketed.BucketedDataParallel):
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None, comm_impl: str = "primitives",
                 *, algorithm: str = "ring", find_unused_parameters: bool = False, init_sync: str = "broadcast"):
        comm = get_comm(group)
        r = comm.rank
        if comm_impl not in ("primitives", "torch"):
            raise ValueError(f"rank {r}: BucketedDataParallel: comm_impl must be 'primitives' or 'torch', got {comm_impl!r}")
        if comm_impl == "torch" and comm.backend == "mpi":
            raise ValueError(f"rank {r}: BucketedDataParallel: comm_impl='torch' needs a torch.distributed "
                             "backend (gloo/nccl); under mpiexec use comm_impl='primitives'")
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"rank {r}: BucketedDataParallel: bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        sync_initial_state(module, comm, init_sync, "BucketedDataParallel", group)
        for n, p in module.named_parameters():    # before touching any .grad: a refusal changes nothing
            owner = getattr(p, "_ringzero_dp", None)
            if p.requires_grad and owner is not None and owner() is not None:
                raise ValueError(f"rank {r}: BucketedDataParallel: parameter {n!r} already belongs to another "
                                 "live BucketedDataParallel; call .remove_hooks() on it first (or drop it)")
        super().__init__(module, comm, bucket_cap_mb, algorithm=algorithm, find_unused_parameters=find_unused_parameters)
        self.group, self.comm_impl = group, comm_impl
        me = weakref.ref(self)
        for p in self._params:
            p._ringzero_dp = me

    def _launch(self, b: int) -> None:
        if self.comm_impl == "primitives":
            return super()._launch(b)
        buf = self.buckets[b].buffer.div_(self.comm.size)   # gloo has no AVG: divide first, as torch DDP does
        self._work[b] = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (after this, backward no longer communicates)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            p._ringzero_dp = None
