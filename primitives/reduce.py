"""Reduce from point-to-point: dst ends with the elementwise op over every rank's tensor.
Other ranks' tensors are left unchanged.

    torchrun --nproc_per_node 4 primitives/run.py reduce
    mpiexec -n 4 python primitives/run.py reduce --backend mpi

Cost for S bytes on N ranks (γ = seconds per byte reduced):
  linear  every rank sends S straight to dst, which reduces N-1 buffers.
          dst receives (N-1)·S; others send S.            (N-1)(α + Sβ + Sγ)
  ring    a pipelined chain dst+1 → dst+2 → … → dst in k = ceil(S / 1 MiB) segments; each rank
          adds its part and forwards: every rank but dst sends S in k messages.
                                                           (N-2+k)(α + (β+γ)S/k)
  tree    binomial tree: each rank receives from its children, reduces, sends S once to its
          parent.                                          ceil(log2 N)(α + Sβ + Sγ)
"""
from primitives.ops import combine_, segments, wait_all


def linear(comm, buf, root, op):
    if comm.rank != root:
        comm.send(buf, root)
        return
    n = comm.size
    tmp = comm.scratch(buf.numel() * (n - 1), buf.dtype, device=buf.device).view(n - 1, -1) if n > 1 else None
    peers = [p for p in range(n) if p != root]
    wait_all([comm.irecv(tmp[i], p) for i, p in enumerate(peers)])
    for i in range(n - 1):                            # fixed rank order: a deterministic sum
        combine_(buf, tmp[i], op)


def ring(comm, buf, root, op):
    n = comm.size
    v = (comm.rank - root - 1) % n                     # chain position: dst+1 is 0, dst is n-1
    prev, nxt = (comm.rank - 1) % n, (comm.rank + 1) % n
    k = segments(buf.numel(), buf.element_size())
    if v == 0:                                         # start of the chain: send my own data
        wait_all([comm.isend(s, nxt) for s in buf.tensor_split(k)])
        return
    acc = buf if comm.rank == root else comm.scratch(buf.numel(), buf.dtype, slot=1, device=buf.device).copy_(buf)
    inc = comm.scratch(buf.numel(), buf.dtype, device=buf.device)
    mine, got = acc.tensor_split(k), inc.tensor_split(k)
    sends, pending = [], comm.irecv(got[0], prev)
    for i in range(k):
        pending.wait()
        if i + 1 < k:
            pending = comm.irecv(got[i + 1], prev)
        combine_(mine[i], got[i], op)
        if comm.rank != root:
            sends.append(comm.isend(mine[i], nxt))
    wait_all(sends)


def tree(comm, buf, root, op):
    n = comm.size
    v = (comm.rank - root) % n
    acc = buf if comm.rank == root else None
    tmp = comm.scratch(buf.numel(), buf.dtype, device=buf.device)
    mask = 1
    while mask < n:
        if v & mask:                                   # my subtree is done: hand it to the parent
            comm.send(acc if acc is not None else buf, (v - mask + root) % n)
            return
        if v + mask < n:
            comm.recv(tmp, (v + mask + root) % n)
            if acc is None:                            # first child: copy so the caller's tensor stays intact
                acc = comm.scratch(buf.numel(), buf.dtype, slot=1, device=buf.device).copy_(buf)
            combine_(acc, tmp, op)
        mask <<= 1
