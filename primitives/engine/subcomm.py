"""Views of a communicator: the ranks of my node (intra) and one rank per node (inter), for the
hierarchical algorithms (hierarchical.py).

    RINGZERO_LOCAL_SIZE=2 torchrun --standalone --nproc_per_node 4 primitives/allreduce.py

The views are not new process groups: they send through the parent's point-to-point with rank
numbers translated, so nothing but primitives/launch.py creates groups, and they work
the same over gloo, nccl and MPI.
"""
from __future__ import annotations

from primitives.engine.checked import CheckedComm
from primitives.engine.topology import SPLITS, TopologyError, topology


class SubComm(CheckedComm):
    """A view of `parent` restricted to `members` (parent group ranks, in order)."""

    def __init__(self, parent: CheckedComm, members: list[int]):
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

    # Strict mode: a view has no process group of its own; on nccl its messages would travel on
    # the parent's pair streams, so they join the parent's simulated streams (one scheduler per
    # process group), with peers translated to parent ranks.
    @property
    def strict(self) -> bool:
        return self.parent.strict if self._strict_flag is None else self._strict_flag

    def _strict_post(self, ops, grouped):
        return self.parent._strict_post([(k, t, self.members[p]) for k, t, p in ops], grouped)


def split(comm: CheckedComm) -> tuple[SubComm, SubComm]:
    """(intra-node, inter-node) views of `comm`. Needs the same number of its ranks on every node."""
    key = (id(comm), comm.rank)
    if key not in SPLITS:
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
        SPLITS[key] = (SubComm(comm, local), SubComm(comm, [on[n][j] for n in order]))
    return SPLITS[key]


def shape(comm) -> tuple[int, int]:
    """(m nodes, k ranks per node) of this communicator; k = size when it is all on one node."""
    intra, inter = split(comm)
    return inter.size, intra.size


def grid(comm) -> list[list[int]]:
    """grid[i][j] = the rank of `comm` that is local rank j on node i (nodes in rank order)."""
    topo = topology(comm)
    node = [topo.node_of(comm.global_rank(p)) for p in range(comm.size)]
    order = sorted(set(node), key=node.index)
    return [[p for p in range(comm.size) if node[p] == n] for n in order]
