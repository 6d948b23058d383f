"""Broadcast from point-to-point: after the call every rank holds src's tensor.

    torchrun --nproc_per_node 4 primitives/run.py broadcast
    mpiexec -n 4 python primitives/run.py broadcast --backend mpi

Cost for S bytes on N ranks (α = latency per message, β = seconds per byte):
  linear  the root sends S to each of the N-1 others.      root sends (N-1)·S; (N-1)α + (N-1)Sβ
          (The engine's checked call carries S ≤ 64 KiB this way inside its check round.)
  ring    a pipelined chain root → root+1 → … in k = ceil(S / 1 MiB) segments; every rank but
          the last forwards S bytes in k messages.          (N-2+k)(α + Sβ/k)
  tree    binomial tree: a rank receives S once from its parent and sends S to each child;
          the root sends ceil(log2 N) messages.            ceil(log2 N)(α + Sβ)
"""
from primitives.ops import segments, wait_all


def linear(comm, buf, root):
    if comm.rank == root:
        wait_all([comm.isend(buf, p) for p in range(comm.size) if p != root])
    else:
        comm.recv(buf, root)


def ring(comm, buf, root):
    n = comm.size
    v = (comm.rank - root) % n                       # position in the chain
    prev, nxt = (comm.rank - 1) % n, (comm.rank + 1) % n
    segs = buf.tensor_split(segments(buf.numel(), buf.element_size()))
    sends = []
    if v == 0:
        sends = [comm.isend(s, nxt) for s in segs]
    else:
        pending = comm.irecv(segs[0], prev)
        for i, s in enumerate(segs):
            pending.wait()
            if i + 1 < len(segs):                    # post the next receive before forwarding
                pending = comm.irecv(segs[i + 1], prev)
            if v < n - 1:
                sends.append(comm.isend(s, nxt))
    wait_all(sends)


def tree(comm, buf, root):
    n = comm.size
    v = (comm.rank - root) % n
    mask = 1
    while mask < n:                                   # receive from the parent: clear the lowest set bit
        if v & mask:
            comm.recv(buf, (v - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:                                   # send to children v+mask, largest subtree first
        if v + mask < n:
            sends.append(comm.isend(buf, (v + mask + root) % n))
        mask >>= 1
    wait_all(sends)
