"""Two-level (hierarchical) collectives: algorithm="hierarchical" for all_reduce, all_gather(_single)
and reduce_scatter(_single). Chosen by algorithm="auto" when the ranks span more than one node.

    python -m multinode run -- torchrun --nnodes 2 --nproc_per_node 2 --node_rank '$NODE_RANK' \\
        --master_addr '$MASTER_ADDR' --master_port '$MASTER_PORT' primitives/allreduce.py
    RINGZERO_LOCAL_SIZE=2 torchrun --standalone --nproc_per_node 4 primitives/allreduce.py   # 2 "nodes" on one host

m nodes × k ranks per node (topology.py); intra = my node's ranks, inter = one rank per
node with my local index j. A flat ring treats every hop alike, so with ranks numbered node by
node each node's one outgoing inter-node hop carries all of its traffic: 2(N-1)/N·S per direction
for an all-reduce. Here the slow link carries only what must cross it:

  all-reduce  1. intra ring reduce-scatter: rank j ends with chunk j+1 (of k) summed over the node
              2. inter ring all-reduce of that S/k chunk with the same-j ranks of the other nodes
              3. intra ring all-gather of the k finished chunks
              per rank: 2(k-1)/k·S intra, 2(m-1)/m·S/k inter  (a node: 2(m-1)/m·S, vs 2(N-1)/N·S flat)
              time ≈ 2(k-1)(α_a + S/k·β_a) + 2(m-1)(α_e + S/m·β_e)   (k streams share one NIC)
  all-gather  (s = one rank's block) 1. inter ring all-gather of my block among the same-j ranks,
              2. m intra ring all-gathers, one per node's blocks. Per rank (m-1)·s inter,
              m(k-1)·s intra; a node sends k(m-1)·s across, the minimum.
  reduce-scatter  the mirror image: m intra ring reduce-scatters (one per node's blocks) into
              partial sums, then an inter ring reduce-scatter of the m partials. Per rank
              m(k-1)·s intra, (m-1)·s inter.
Every rank of an all-reduce ends bitwise-identical: each chunk is reduced once per node, then by
one inter-node ring whose result every member copies.

The views (SubComm, split) are not new process groups: they send through the parent's
point-to-point with rank numbers translated, so nothing but primitives/launch.py creates groups,
and they work the same over gloo, nccl and MPI (ZeRO++'s hpZ and qgZ use them too).
"""
from __future__ import annotations

from primitives.all_gather import ring as all_gather_ring
from primitives.all_reduce import ring as all_reduce_ring, ring_all_gather, ring_reduce_scatter
from primitives.engine.checked import CheckedComm
from primitives.engine.topology import SPLITS, TopologyError, topology
from primitives.ops import chunk_bounds
from primitives.reduce_scatter import ring as reduce_scatter_ring


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


# ----------------------------------------------------------------------------- the two-level algorithms

def all_reduce_2level(comm, buf, op):
    intra, inter = split(comm)
    k, j = intra.size, intra.rank
    chunk = [buf[s:e] for s, e in chunk_bounds(buf.numel(), k)]
    ring_reduce_scatter(intra, chunk, op)          # rank j now owns chunk (j+1) % k for the node
    if inter.size > 1:
        all_reduce_ring(inter, chunk[(j + 1) % k], op)     # the same chunk index on every node
    ring_all_gather(intra, chunk)


def all_gather_2level(comm, blocks):
    intra, inter = split(comm)
    g = grid(comm)
    j = intra.rank
    if inter.size > 1:
        all_gather_ring(inter, [blocks[g[i][j]] for i in range(inter.size)])
    if intra.size > 1:
        for row in g:                               # node i's k blocks, one held by each local rank
            all_gather_ring(intra, [blocks[p] for p in row])


def reduce_scatter_2level(comm, blocks, out, op):
    intra, inter = split(comm)
    g = grid(comm)
    m, k = inter.size, intra.size
    partial = comm.scratch(m * out.numel(), out.dtype, slot=6).view(m, -1)
    for i, row in enumerate(g):                     # partial[i] = my node's sum of block g[i][j]
        if k > 1:
            reduce_scatter_ring(intra, [blocks[p] for p in row], partial[i], op)
        else:
            partial[i].copy_(blocks[row[0]])
    if m > 1:
        # in place on our own scratch, receive posted before send (reduce_scatter.ring posts its
        # first send first: measured 1.35× slower across the shaped link with gloo); the ring's
        # reduce-scatter half leaves inter rank i owning chunk i+1, so rotate the list by one
        ring_reduce_scatter(inter, [partial[(x - 1) % m] for x in range(m)], op)
    out.copy_(partial[inter.rank])
