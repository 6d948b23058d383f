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
"""
from __future__ import annotations

from primitives.all_gather import ring as all_gather_ring
from primitives.all_reduce import ring as all_reduce_ring, ring_all_gather, ring_reduce_scatter
from primitives.engine.subcomm import grid, split
from primitives.ops import chunk_bounds
from primitives.reduce_scatter import ring as reduce_scatter_ring


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
