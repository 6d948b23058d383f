"""ringzero.primitives: collectives built only from point-to-point send/recv.

Drop-in for torch.distributed: same positional arguments, same in-place semantics, plus a
keyword-only `algorithm=` (see ALGORITHMS; "auto" picks by the α-β cost model).
"""
from primitives.algos import ALGORITHMS
from primitives.all_gather import all_gather, all_gather_single
from primitives.all_reduce import all_reduce
from primitives.all_to_all import all_to_all, all_to_all_single
from primitives.broadcast import broadcast
from primitives.comm import Communicator, PeerError, get_comm
from primitives.engine.core import CollectiveError, ReduceOp, handshake_enabled, set_handshake
from primitives.gather import gather
from primitives.engine.ledger import LEDGER
from primitives.reduce import reduce
from primitives.reduce_scatter import reduce_scatter, reduce_scatter_single
from primitives.scatter import scatter
from primitives.engine.strict import StrictOrderError, set_strict_p2p


def algorithms_for(name: str, comm) -> list[str]:
    """ALGORITHMS[name], plus "shm" when every rank of comm shares this host's memory (shm.py)."""
    from primitives.engine.cost import SHM_NATIVE
    return ALGORITHMS[name] + (["shm"] if getattr(comm, "transport", None) == "shm" and name in SHM_NATIVE else [])


__all__ = ["algorithms_for", "broadcast", "reduce", "all_reduce", "all_gather", "all_gather_single", "scatter", "gather",
           "reduce_scatter", "reduce_scatter_single", "all_to_all", "all_to_all_single", "ALGORITHMS", "ReduceOp",
           "LEDGER", "get_comm", "Communicator", "PeerError", "CollectiveError", "set_handshake", "handshake_enabled",
           "StrictOrderError", "set_strict_p2p"]
