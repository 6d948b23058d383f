"""Which ranks share a node: the topology that hierarchical collectives and the ledger's
intra-/inter-node byte counts are built on.

    comm.node_of(rank)       node index of a rank (0 .. num_nodes-1)
    comm.intra_node()        a Communicator over the ranks of my node
    comm.inter_node()        a Communicator over one rank per node: those with my local index

Where it comes from (no communication, so it is free and every rank agrees by construction):
  * the launcher's "ranks on this node": LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (deepspeed),
    MPI_LOCALNRANKS (MPICH), OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI); all of them number ranks
    node by node, so node_of(r) = r // local_size;
  * RINGZERO_LOCAL_SIZE=k overrides it: pretend consecutive blocks of k ranks are nodes (how the
    default test suite exercises two "nodes" on one host);
  * nothing set (spawn, plain python): one node.
`Topology.from_hostnames(comm)` instead exchanges hostnames (a collective: every rank must call
it) for launches that number ranks some other way; `set_topology(comm, topo)` installs one.

The intra-/inter-node views themselves: subcomm.py.
"""
from __future__ import annotations

import collections
import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from primitives.engine.ledger import LEDGER

_ENV_LOCAL = ("RINGZERO_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS",
              "OMPI_COMM_WORLD_LOCAL_SIZE")


class TopologyError(ValueError):
    """A topology the hierarchical algorithms cannot use (e.g. uneven ranks per node)."""


@dataclass(frozen=True)
class Topology:
    nodes: tuple[int, ...]          # world rank -> node index, nodes numbered 0.. in rank order

    @classmethod
    def blocks(cls, world: int, local_size: int) -> "Topology":
        if local_size < 1 or world % local_size:
            raise TopologyError(f"{local_size} ranks per node does not divide the world size {world}")
        return cls(tuple(r // local_size for r in range(world)))

    @classmethod
    def from_env(cls, world: int, env=os.environ) -> "Topology":
        for key in _ENV_LOCAL:
            if env.get(key):
                k = int(env[key])
                if world % k:   # e.g. a subgroup of a bigger launch: fall back to one node
                    raise TopologyError(f"{key}={k} does not divide the world size {world}")
                return cls.blocks(world, k)
        return cls((0,) * world)

    @classmethod
    def from_hostnames(cls, comm) -> "Topology":
        """Collective: every rank of the world communicator `comm` sends its hostname to all."""
        name = socket.gethostname().encode()[:63]
        mine = torch.zeros(64, dtype=torch.uint8, device=comm.device)
        mine[:len(name)] = torch.tensor(list(name), dtype=torch.uint8)
        table = torch.zeros(comm.size, 64, dtype=torch.uint8, device=comm.device)
        table[comm.rank] = mine
        with LEDGER.control_traffic():
            peers = [p for p in range(comm.size) if p != comm.rank]
            reqs = [comm.irecv(table[p], p) for p in peers] + [comm.isend(mine, p) for p in peers]
            for r in reqs:
                r.wait()
        names = [bytes(row.cpu().tolist()).rstrip(b"\0") for row in table]
        first = {}
        return cls(tuple(first.setdefault(h, len(first)) for h in names))

    @property
    def num_nodes(self) -> int:
        return max(self.nodes) + 1 if self.nodes else 1

    def node_of(self, rank: int) -> int:
        return self.nodes[rank]

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def local_size(self) -> int:
        """Ranks per node; raises unless every node has the same number."""
        sizes = {len(self.ranks_on(n)) for n in range(self.num_nodes)}
        if len(sizes) != 1:
            raise TopologyError(f"hierarchical collectives need the same number of ranks on every node; "
                                f"got {[len(self.ranks_on(n)) for n in range(self.num_nodes)]}")
        return sizes.pop()


_WORLD: dict = {}     # id(world communicator or None) -> Topology
SPLITS: dict = {}     # (id(comm), rank) -> its (intra, inter) views (subcomm.py); a new topology drops them


def set_topology(comm, topo: Topology) -> None:
    _WORLD[_root_key(comm)] = topo
    SPLITS.clear()


def _root_key(comm):
    while hasattr(comm, "parent"):   # a view (subcomm.py): ask its parent
        comm = comm.parent
    return id(comm) if getattr(comm, "group", None) is not None else None   # world comms share one


def topology(comm) -> Topology:
    """The topology of the world `comm` belongs to (indexed by global rank)."""
    key = _root_key(comm)
    t = _WORLD.get(key) if key in _WORLD else _WORLD.get(None)
    if t is None or (key is None and len(t.nodes) != _world_size(comm)):   # a new world: re-read
        try:
            t = Topology.from_env(_world_size(comm))
        except TopologyError as e:   # e.g. uneven nodes: say so once, and treat the world as one node
            warnings.warn(f"primitives.engine.topology: {e}; treating all ranks as one node "
                          "(call set_topology() or Topology.from_hostnames() to say otherwise)", stacklevel=2)
            t = Topology((0,) * _world_size(comm))
        _WORLD[None] = t
    return t


def _world_size(comm) -> int:
    while hasattr(comm, "parent"):   # a view (subcomm.py): ask its parent
        comm = comm.parent
    if getattr(comm, "group", None) is not None and dist.is_initialized():
        return dist.get_world_size()
    return comm.size


def prefers_hierarchical(comm) -> bool:
    """algorithm="auto": use the two-level algorithms (subcomm.py) when this group spans more
    than one node with the same number of ranks on each (otherwise the flat choice stands)."""
    if comm.size < 2:
        return False
    topo = topology(comm)
    per_node = collections.Counter(topo.node_of(comm.global_rank(p)) for p in range(comm.size))
    return len(per_node) > 1 and len(set(per_node.values())) == 1
