"""Reduce from point-to-point: dst ends with the elementwise op over every rank's tensor.
Other ranks' tensors are left unchanged.

    torchrun --nproc_per_node 4 primitives/reduce.py
    mpiexec -n 4 python primitives/reduce.py --backend mpi

Cost for S bytes on N ranks (γ = seconds per byte reduced):
  linear  every rank sends S straight to dst, which reduces N-1 buffers.
          dst receives (N-1)·S; others send S.            (N-1)(α + Sβ + Sγ)
  ring    a pipelined chain dst+1 → dst+2 → … → dst in k = ceil(S / 1 MiB) segments; each rank
          adds its part and forwards: every rank but dst sends S in k messages.
                                                           (N-2+k)(α + (β+γ)S/k)
  tree    binomial tree: each rank receives from its children, reduces, sends S once to its
          parent.                                          ceil(log2 N)(α + Sβ + Sγ)
"""
from __future__ import annotations

from primitives.engine.core import (Check, combine_, finish_avg_, flat_work, get_comm, pipeline_segments,
                             resolve, run, scratch, wait_all)


def _linear(comm, buf, root, op):
    if comm.rank != root:
        comm.send(buf, root)
        return
    n = comm.size
    tmp = scratch(comm, buf.numel() * (n - 1), buf.dtype, device=buf.device).view(n - 1, -1) if n > 1 else None
    peers = [p for p in range(n) if p != root]
    wait_all([comm.irecv(tmp[i], p) for i, p in enumerate(peers)])
    for i in range(n - 1):                            # fixed rank order: a deterministic sum
        combine_(buf, tmp[i], op)


def _ring(comm, buf, root, op):
    n = comm.size
    v = (comm.rank - root - 1) % n                     # chain position: dst+1 is 0, dst is n-1
    prev, nxt = (comm.rank - 1) % n, (comm.rank + 1) % n
    k = pipeline_segments(buf)
    if v == 0:                                         # start of the chain: send my own data
        wait_all([comm.isend(s, nxt) for s in buf.tensor_split(k)])
        return
    acc = buf if comm.rank == root else scratch(comm, buf.numel(), buf.dtype, slot=1, device=buf.device).copy_(buf)
    inc = scratch(comm, buf.numel(), buf.dtype, device=buf.device)
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


def _tree(comm, buf, root, op):
    n = comm.size
    v = (comm.rank - root) % n
    acc = buf if comm.rank == root else None
    tmp = scratch(comm, buf.numel(), buf.dtype, device=buf.device)
    mask = 1
    while mask < n:
        if v & mask:                                   # my subtree is done: hand it to the parent
            comm.send(acc if acc is not None else buf, (v - mask + root) % n)
            return
        if v + mask < n:
            comm.recv(tmp, (v + mask + root) % n)
            if acc is None:                            # first child: copy so the caller's tensor stays intact
                acc = scratch(comm, buf.numel(), buf.dtype, slot=1, device=buf.device).copy_(buf)
            combine_(acc, tmp, op)
        mask <<= 1


ALGOS = {"linear": _linear, "ring": _ring, "tree": _tree}


def reduce(tensor, dst, op=None, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce(tensor, dst, op): the result lands in dst's tensor."""
    from primitives.engine.core import ReduceOp
    op = ReduceOp.SUM if op is None else op
    comm = get_comm(group)
    check = Check(comm, "reduce")
    ok = check.tensor("tensor", tensor)
    root = check.rank("dst", dst)
    opn = check.op(op, tensor.dtype if ok else None)
    nbytes = tensor.numel() * tensor.element_size() if ok else 0
    algo = resolve("reduce", algorithm, ALGOS, comm, nbytes, check)

    def body():
        buf, copied = flat_work(tensor)
        if buf.numel() and comm.size > 1:
            ALGOS[algo](comm, buf, root, opn)
        if comm.rank == root:
            finish_avg_(buf, opn, comm.size)
            if copied:
                tensor.copy_(buf.view_as(tensor))
    return run(comm, "reduce", algo, check, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=opn, root=root,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag)


if __name__ == "__main__":
    from primitives.engine.runner import main
    main("reduce")
