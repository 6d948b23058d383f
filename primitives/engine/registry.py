"""get_comm(group): the engine's communicator for a torch process group (or MPI's world).

One communicator per group, built once: ShmComm on gloo (shared memory between the ranks of a
host, TCP otherwise; RINGZERO_TRANSPORT=auto|shm|tcp), the CheckedTorchComm on nccl, MPIComm
when launched with --backend mpi.
"""
from __future__ import annotations

import torch.distributed as dist

from primitives.comm import Communicator
from primitives.engine.checked import NOT_INIT_MSG, check_member
from primitives.engine.errors import NotInitializedError
from primitives.engine.mpi_comm import MPIComm
from primitives.engine.shm import build

_MPI_WORLD: MPIComm | None = None
_COMMS: dict = {}


def set_mpi_world(comm: MPIComm | None) -> None:
    global _MPI_WORLD
    _MPI_WORLD = comm
    _COMMS.clear()


def get_comm(group=None) -> Communicator:
    """The communicator for `group` (None = the default group, or MPI's COMM_WORLD)."""
    if _MPI_WORLD is not None:
        if group is None or group is _MPI_WORLD:
            return _MPI_WORLD
        if isinstance(group, Communicator):
            return group
        key = ("mpi", id(group))
        if key not in _COMMS:
            _COMMS[key] = MPIComm(group, _MPI_WORLD.timeout)
        return _COMMS[key]
    if isinstance(group, Communicator):
        return group
    if not dist.is_initialized():
        raise NotInitializedError(NOT_INIT_MSG)
    if group is dist.group.WORLD:            # the same group as None: one communicator for both
        group = None
    key = id(group) if group is not None else None
    c = _COMMS.get(key)
    if c is None or c.group is not group:
        check_member(group)                 # first: build() asks the group for its backend
        c = _COMMS[key] = build(group)       # ShmComm on gloo (falls back to TCP), CheckedTorchComm otherwise
    return c
