"""ringzero.primitives: collectives built only from point-to-point send/recv.

The textbook (read these): comm.py (the Communicator), ops.py (chunk rule, reduce ops), one file
of algorithms per collective (all_reduce.py, broadcast.py, reduce.py, all_gather.py,
reduce_scatter.py, scatter.py, gather.py, all_to_all.py), coalesced.py, shm.py (the same
collectives over a shared-memory segment), mesh.py.
The engine (primitives/engine/) runs those same algorithms checked, counted and chosen by cost.

Drop-in for torch.distributed: `primitives.all_reduce(tensor, op, group, async_op, algorithm=,
tag=)` and the other collectives (with torch's signatures), the *_coalesced and *_object calls,
get_comm(group), LEDGER, ReduceOp, ... come from the engine.
"""
import importlib

import torch.distributed as dist

# The textbook modules first: importing a submodule binds its name on this package, and the
# names all_reduce, broadcast, ... below must stay the engine's drop-in functions.
from primitives import (all_gather, all_reduce, all_to_all, broadcast, coalesced, comm, gather, ops,  # noqa: F401
                        reduce, reduce_scatter, scatter)
from primitives.comm import Communicator

del all_gather, all_reduce, all_to_all, broadcast, gather, reduce, reduce_scatter, scatter

ReduceOp = dist.ReduceOp

_ENGINE = {   # public name -> the engine module that defines it
    **{n: "primitives.engine.api" for n in (
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "reduce_scatter",
        "reduce_scatter_single", "scatter", "gather", "all_to_all", "all_to_all_single", "algorithms_for",
        "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_coalesced", "all_gather_coalesced")},
    **{n: "primitives.engine.objects" for n in (
        "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")},
    "Work": "primitives.comm", "submit": "primitives.engine.core",
    "ALGORITHMS": "primitives.engine.algos", "get_comm": "primitives.engine.registry",
    "LEDGER": "primitives.engine.ledger", "PeerError": "primitives.engine.errors",
    "CollectiveError": "primitives.engine.errors", "set_handshake": "primitives.engine.planned",
    "handshake_enabled": "primitives.engine.planned", "StrictOrderError": "primitives.engine.strict",
    "set_strict_p2p": "primitives.engine.strict",
}


def __getattr__(name):
    # PEP 562: the engine loads on first use, so importing a textbook module loads none of it
    if name not in _ENGINE:
        raise AttributeError(f"module 'primitives' has no attribute {name!r}")
    value = getattr(importlib.import_module(_ENGINE[name]), name)
    globals()[name] = value
    return value


__all__ = ["algorithms_for", "broadcast", "reduce", "all_reduce", "all_gather", "all_gather_single", "scatter", "gather",
           "reduce_scatter", "reduce_scatter_single", "all_to_all", "all_to_all_single", "ALGORITHMS", "ReduceOp",
           "LEDGER", "get_comm", "Communicator", "PeerError", "CollectiveError", "set_handshake", "handshake_enabled",
           "StrictOrderError", "set_strict_p2p", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_reduce_coalesced", "all_gather_coalesced", "all_gather_object", "broadcast_object_list",
           "gather_object", "scatter_object_list", "Work", "submit"]
