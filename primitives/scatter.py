"""Scatter from point-to-point: rank i receives scatter_list[i] from src.

    torchrun --nproc_per_node 4 primitives/run.py scatter
    mpiexec -n 4 python primitives/run.py scatter --backend mpi

Cost, S = bytes of one block (src holds N·S):
  linear  src sends block i straight to rank i: N-1 messages, (N-1)·S bytes from src.
  ring    a chain src → src+1 → …: src sends the farthest rank's block first; each rank keeps
          the last block it receives and forwards the others. The rank at chain position v
          sends N-1-v blocks.                              (N-1)(α + Sβ), pipelined
  tree    binomial tree: each rank receives its whole subtree's blocks at once and hands each
          child its subtree. src sends ceil(log2 N) messages, (N-1)·S bytes in all.
                                                           log2 N·α + (N-1)Sβ
"""
from primitives.ops import wait_all


def linear(comm, out, blocks, root):
    if comm.rank == root:
        wait_all([comm.isend(blocks[p], p) for p in range(comm.size) if p != root])
        out.copy_(blocks[root])
    else:
        comm.recv(out, root)


def ring(comm, out, blocks, root):
    n = comm.size
    v = (comm.rank - root) % n
    nxt, prev = (comm.rank + 1) % n, (comm.rank - 1) % n
    if v == 0:
        wait_all([comm.isend(blocks[(u + root) % n], nxt) for u in range(n - 1, 0, -1)])
        out.copy_(blocks[root])
        return
    slots = [comm.scratch(out.numel(), out.dtype, slot=i, device=out.device) for i in (0, 1)]
    sends = [None, None]
    for j in range(n - 1 - v):                      # blocks for ranks further down the chain
        buf = slots[j % 2]
        if sends[j % 2] is not None:
            sends[j % 2].wait()                      # never overwrite a buffer still being sent
        comm.recv(buf, prev)
        sends[j % 2] = comm.isend(buf, nxt)
    comm.recv(out, prev)
    wait_all([s for s in sends if s is not None])


def tree(comm, out, blocks, root):
    n, k = comm.size, out.numel()
    v = (comm.rank - root) % n
    low = v & -v if v else 1 << n.bit_length()     # my subtree spans [v, v + low) ∩ [0, n)
    size = min(low, n - v)
    buf = comm.scratch(size * k, out.dtype, device=out.device)
    if v == 0:
        for u in range(n):                           # pack in chain order, so subtrees are contiguous
            buf[u * k:(u + 1) * k].copy_(blocks[(u + root) % n])
    else:
        comm.recv(buf, (v - low + root) % n)
    sends, m = [], low >> 1
    while m:
        if v + m < n:
            end = min(2 * m, size)
            sends.append(comm.isend(buf[m * k:end * k], (v + m + root) % n))
        m >>= 1
    wait_all(sends)
    out.copy_(buf[:k])
