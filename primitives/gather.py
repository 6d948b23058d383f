"""Gather from point-to-point: dst receives every rank's tensor into gather_list, in rank order.

    torchrun --nproc_per_node 4 primitives/gather.py
    mpiexec -n 4 python primitives/gather.py --backend mpi

Cost, S = bytes each rank contributes (dst ends with N·S):
  linear  every rank sends S straight to dst: dst receives N-1 messages, (N-1)·S bytes.
  ring    a chain … → dst+2 → dst+1 → dst: the rank at chain position v sends its own block,
          then forwards the N-1-v blocks from further down. (N-1)(α + Sβ), pipelined
  tree    binomial tree: each rank collects its subtree's blocks contiguously and sends them
          to its parent in one message. dst receives ceil(log2 N) messages.
                                                           log2 N·α + (N-1)Sβ
"""
from __future__ import annotations

from primitives.engine.core import Check, flat_work, get_comm, resolve, run, scratch, wait_all


def _linear(comm, mine, blocks, root):
    if comm.rank == root:
        wait_all([comm.irecv(blocks[p], p) for p in range(comm.size) if p != root])
        blocks[root].copy_(mine)
    else:
        comm.send(mine, root)


def _ring(comm, mine, blocks, root):
    n = comm.size
    v = (comm.rank - root) % n
    nxt, prev = (comm.rank - 1) % n, (comm.rank + 1) % n     # data flows towards dst
    if v == 0:
        for u in range(1, n):                               # arrives in chain order: v = 1, 2, …
            comm.recv(blocks[(u + root) % n], prev)
        blocks[root].copy_(mine)
        return
    sends = [comm.isend(mine, nxt), None]
    slots = [scratch(comm, mine.numel(), mine.dtype, slot=i, device=mine.device) for i in (0, 1)]
    for j in range(n - 1 - v):
        buf = slots[j % 2]
        if j >= 1 and sends[(j + 1) % 2] is not None:
            sends[(j + 1) % 2].wait()
        comm.recv(buf, prev)
        sends[(j + 1) % 2] = comm.isend(buf, nxt)
    wait_all([s for s in sends if s is not None])


def _tree(comm, mine, blocks, root):
    n, k = comm.size, mine.numel()
    v = (comm.rank - root) % n
    low = v & -v if v else 1 << n.bit_length()
    size = min(low, n - v)
    buf = scratch(comm, size * k, mine.dtype, device=mine.device)
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


ALGOS = {"linear": _linear, "ring": _ring, "tree": _tree}


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.gather(tensor, gather_list, dst); gather_list is written on dst only."""
    comm = get_comm(group)
    check = Check(comm, "gather")
    ok = check.tensor("tensor", tensor)
    root = check.rank("dst", dst)
    is_root = comm.rank == root
    ok = ok and not check.errors                 # a bad root already explains itself
    if ok and is_root:
        ok = check.tensor_list("gather_list", gather_list, tensor)
    elif ok and gather_list not in (None, []):
        check.fail(f"argument 'gather_list' must be None on non-dst ranks (dst is {dst})")
        ok = False
    nbytes = tensor.numel() * tensor.element_size() * comm.size if ok else 0   # S: all N blocks
    algo = resolve("gather", algorithm, ALGOS, comm, nbytes, check)

    def body():
        mine, _ = flat_work(tensor)
        work = [flat_work(b) for b in gather_list] if is_root else None
        blocks = [w for w, _ in work] if is_root else None
        if comm.size == 1:
            blocks[0].copy_(mine)
        elif mine.numel():
            ALGOS[algo](comm, mine, blocks, root)
        if is_root:
            for orig, (w, copied) in zip(gather_list, work):
                if copied:
                    orig.copy_(w.view_as(orig))
    return run(comm, "gather", algo, check, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=None, root=root,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag)


if __name__ == "__main__":
    from primitives.engine.runner import main
    main("gather")
