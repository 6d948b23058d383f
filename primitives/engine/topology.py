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

The sub-communicators are views, not new process groups: they send through the parent's
point-to-point with rank numbers translated, so nothing but primitives/engine/launch.py creates groups,
and they work the same over gloo, nccl and MPI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from primitives.comm import Communicator

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
    def from_hostnames(cls, comm: Communicator) -> "Topology":
        """Collective: every rank of the world communicator `comm` sends its hostname to all."""
        import socket

        import torch

        from primitives.engine.ledger import LEDGER
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


def set_topology(comm: Communicator, topo: Topology) -> None:
    _WORLD[_root_key(comm)] = topo
    _SPLITS.clear()


def _root_key(comm):
    while isinstance(comm, SubComm):
        comm = comm.parent
    return id(comm) if getattr(comm, "group", None) is not None else None   # world comms share one


def topology(comm: Communicator) -> Topology:
    """The topology of the world `comm` belongs to (indexed by global rank)."""
    key = _root_key(comm)
    t = _WORLD.get(key) if key in _WORLD else _WORLD.get(None)
    if t is None or (key is None and len(t.nodes) != _world_size(comm)):   # a new world: re-read
        try:
            t = Topology.from_env(_world_size(comm))
        except TopologyError as e:   # e.g. uneven nodes: say so once, and treat the world as one node
            import warnings
            warnings.warn(f"primitives.engine.topology: {e}; treating all ranks as one node "
                          "(call set_topology() or Topology.from_hostnames() to say otherwise)", stacklevel=2)
            t = Topology((0,) * _world_size(comm))
        _WORLD[None] = t
    return t


def _world_size(comm) -> int:
    import torch.distributed as dist
    while isinstance(comm, SubComm):
        comm = comm.parent
    if getattr(comm, "group", None) is not None and dist.is_initialized():
        return dist.get_world_size()
    return comm.size


class SubComm(Communicator):
    """A view of `parent` restricted to `members` (parent group ranks, in order)."""

    def __init__(self, parent: Communicator, members: list[int]):
        self.parent, self.members = parent, list(members)
        self.rank, self.size = self.members.index(parent.rank), len(self.members)
        self.backend, self.device, self.timeout = parent.backend, parent.device, parent.timeout
        self.builtin = None      # no built-in reference for a view: compare against the world's

    def global_rank(self, group_rank: int) -> int:
        return self.parent.global_rank(self.members[group_rank])

    def _isend(self, tensor, peer):
        return self.parent._isend(tensor, self.members[peer])

    def _irecv(self, tensor, peer):
        return self.parent._irecv(tensor, self.members[peer])

    def _wait(self, handle):
        return self.parent._wait(handle)

    # Strict mode (primitives/engine/strict.py): a view has no process group of its own; on nccl its
    # messages would travel on the parent's pair streams, so they join the parent's simulated
    # streams (one scheduler per process group), with peers translated to parent ranks.
    @property
    def strict(self) -> bool:
        return self.parent.strict if self._strict_flag is None else self._strict_flag

    def _strict_post(self, ops, grouped):
        return self.parent._strict_post([(k, t, self.members[p]) for k, t, p in ops], grouped)


_SPLITS: dict = {}


def split(comm: Communicator) -> tuple[SubComm, SubComm]:
    """(intra-node, inter-node) views of `comm`. Needs the same number of its ranks on every node."""
    key = (id(comm), comm.rank)
    if key not in _SPLITS:
        topo = topology(comm)
        node = [topo.node_of(comm.global_rank(p)) for p in range(comm.size)]
        order = sorted(set(node), key=node.index)
        on = {n: [p for p in range(comm.size) if node[p] == n] for n in order}
        sizes = [len(v) for v in on.values()]
        if len(set(sizes)) != 1:
            raise TopologyError(f"rank {comm.rank}: hierarchical collectives need the same number of ranks "
                                f"on every node; this group has {dict(zip(order, sizes))} (node: ranks)")
        local = on[node[comm.rank]]
        j = local.index(comm.rank)
        _SPLITS[key] = (SubComm(comm, local), SubComm(comm, [on[n][j] for n in order]))
    return _SPLITS[key]


def shape(comm: Communicator) -> tuple[int, int]:
    """(m nodes, k ranks per node) of this communicator; k = size when it is all on one node."""
    intra, inter = split(comm)
    return inter.size, intra.size


def grid(comm: Communicator) -> list[list[int]]:
    """grid[i][j] = the rank of `comm` that is local rank j on node i (nodes in rank order)."""
    topo = topology(comm)
    node = [topo.node_of(comm.global_rank(p)) for p in range(comm.size)]
    order = sorted(set(node), key=node.index)
    return [[p for p in range(comm.size) if node[p] == n] for n in order]


def prefers_hierarchical(comm: Communicator) -> bool:
    """algorithm="auto": use the two-level algorithms when this group spans more than one node
    (with the same number of ranks on each; otherwise the flat choice stands)."""
    if comm.size < 2:
        return False
    try:
        m, k = shape(comm)
    except TopologyError:
        return False
    return m > 1
