"""Broadcast from point-to-point: after the call every rank holds src's tensor.

    torchrun --nproc_per_node 4 primitives/broadcast.py
    mpiexec -n 4 python primitives/broadcast.py --backend mpi

Cost for S bytes on N ranks (α = latency per message, β = seconds per byte):
  linear  the root sends S to each of the N-1 others.      root sends (N-1)·S; (N-1)α + (N-1)Sβ
          With the check on and S ≤ 64 KiB, the data rides in the root's check envelopes
          (envelope.py): one round for check and data, what auto picks.
  ring    a pipelined chain root → root+1 → … in k = ceil(S / 1 MiB) segments; every rank but
          the last forwards S bytes in k messages.          (N-2+k)(α + Sβ/k)
  tree    binomial tree: a rank receives S once from its parent and sends S to each child;
          the root sends ceil(log2 N) messages.            ceil(log2 N)(α + Sβ)
"""
from __future__ import annotations

from primitives.engine.core import Check, LazyFlat, fuses, get_comm, pipeline_segments, resolve, run, wait_all
from primitives.engine.envelope import Fused


def _linear(comm, buf, root):
    if comm.rank == root:
        wait_all([comm.isend(buf, p) for p in range(comm.size) if p != root])
    else:
        comm.recv(buf, root)


def _ring(comm, buf, root):
    n = comm.size
    v = (comm.rank - root) % n                       # position in the chain
    prev, nxt = (comm.rank - 1) % n, (comm.rank + 1) % n
    segs = buf.tensor_split(pipeline_segments(buf))
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


def _tree(comm, buf, root):
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


ALGOS = {"linear": _linear, "ring": _ring, "tree": _tree}


def broadcast(tensor, src, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.broadcast: tensor on every rank becomes src's tensor (src is a global rank)."""
    comm = get_comm(group)
    check = Check(comm, "broadcast")
    ok = check.tensor("tensor", tensor)
    root = check.rank("src", src)
    nbytes = tensor.numel() * tensor.element_size() if ok else 0
    algo = resolve("broadcast", algorithm, ALGOS, comm, nbytes, check)

    prep = LazyFlat(tensor)
    done = prep.copy_back

    def body():
        buf = prep()
        if buf.numel() and comm.size > 1:
            ALGOS[algo](comm, buf, root)
        done()

    def finish(got):                             # fused: the root's data came in its envelope
        buf = prep()
        nb = buf.numel() * buf.element_size()
        if comm.rank != root:
            buf.copy_(got(nb, buf.dtype)[root])
            done()
        return {root: nb} if comm.rank != root else {}    # by peer: only the root sent data
    fused = (Fused(lambda peer: prep() if comm.rank == root else None, finish, same_for_all=True)
             if ok and tensor.numel() and fuses("broadcast", algo, comm, nbytes) else None)
    return run(comm, "broadcast", algo, check, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=None, root=root,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               fused=fused)


if __name__ == "__main__":
    from primitives.engine.runner import main
    main("broadcast")
