"""Gather from point-to-point: dst receives every rank's tensor into gather_list, in rank order.

    torchrun --nproc_per_node 4 primitives/run.py gather
    mpiexec -n 4 python primitives/run.py gather --backend mpi

Cost, S = bytes each rank contributes (dst ends with N·S):
  linear  every rank sends S straight to dst: dst receives N-1 messages, (N-1)·S bytes.
  ring    a chain … → dst+2 → dst+1 → dst: the rank at chain position v sends its own block,
          then forwards the N-1-v blocks from further down. (N-1)(α + Sβ), pipelined
  tree    binomial tree: each rank collects its subtree's blocks contiguously and sends them
          to its parent in one message. dst receives ceil(log2 N) messages.
                                                           log2 N·α + (N-1)Sβ
"""
from primitives.ops import wait_all


def linear(comm, mine, blocks, root):
    if comm.rank == root:
        wait_all([comm.irecv(blocks[p], p) for p in range(comm.size) if p != root])
        blocks[root].copy_(mine)
    else:
        comm.send(mine, root)


def ring(comm, mine, blocks, root):
    n = comm.size
    v = (comm.rank - root) % n
    nxt, prev = (comm.rank - 1) % n, (comm.rank + 1) % n     # data flows towards dst
    if v == 0:
        for u in range(1, n):                               # arrives in chain order: v = 1, 2, …
            comm.recv(blocks[(u + root) % n], prev)
        blocks[root].copy_(mine)
        return
    sends = [comm.isend(mine, nxt), None]
    slots = [comm.scratch(mine.numel(), mine.dtype, slot=i, device=mine.device) for i in (0, 1)]
    for j in range(n - 1 - v):
        buf = slots[j % 2]
        if j >= 1 and sends[(j + 1) % 2] is not None:
            sends[(j + 1) % 2].wait()
        comm.recv(buf, prev)
        sends[(j + 1) % 2] = comm.isend(buf, nxt)
    wait_all([s for s in sends if s is not None])


def tree(comm, mine, blocks, root):
    n, k = comm.size, mine.numel()
    v = (comm.rank - root) % n
    low = v & -v if v else 1 << n.bit_length()
    size = min(low, n - v)
    buf = comm.scratch(size * k, mine.dtype, device=mine.device)
    buf[:k].copy_(mine)
    m, reqs = 1, []
    while m < low and v + m < n:                    # children v+1, v+2, v+4, …
        end = min(2 * m, size)
        reqs.append(comm.irecv(buf[m * k:end * k], (v + m + root) % n))
        m <<= 1
    wait_all(reqs)
    if v == 0:
        for u in range(n):
            blocks[(u + root) % n].copy_(buf[u * k:(u + 1) * k])
    else:
        comm.send(buf, (v - low + root) % n)
