"""All-reduce from point-to-point: every rank ends with the elementwise op over all tensors.

    torchrun --nproc_per_node 4 primitives/all_reduce.py        (also: primitives/allreduce.py)
    mpiexec -n 4 python primitives/all_reduce.py --backend mpi

Cost for S bytes on N ranks; P = largest power of two ≤ N, R = N - P ranks fold in first:
  linear              reduce to rank 0, broadcast back (a star). Rank 0 receives and sends
                      (N-1)·S; the others send S.          2(N-1)(α + Sβ)
  ring                reduce-scatter then all-gather over N chunks (tensor_split sizes).
                      2(N-1) messages, 2(N-1)/N·S bytes per rank.  2(N-1)α + 2(N-1)/N·Sβ
  direct              reduce-scatter then all-gather, each in one round where every rank
                      talks to every other at once (see reduce_scatter.py / all_gather.py):
                      2(N-1) messages and the ring's 2(N-1)/N·S bytes, but 2 rounds instead
                      of 2(N-1) dependent steps.     2α + 2(N-2)·o + 2(N-1)/N·Sβ
  one_shot            every rank sends its whole buffer to every other rank in one round and
                      reduces the N buffers in rank order: (N-1)·S bytes per rank, but one
                      step. With the check on, a call of ≤ 64 KiB rides inside the check's
                      envelopes (envelope.py), so the check costs no round of its own:
                      what auto picks for small calls.   α + (N-2)·o + (N-1)·S(β + γ)
  recursive_doubling  log2 P exchanges of the whole buffer with rank ^ 2^k (+1 fold message
                      before and after when N is not a power of two). log2 P·S per rank.
                                                           log2 P·(α + Sβ + Sγ)
  rabenseifner        recursive halving reduce-scatter, then recursive doubling all-gather,
                      over P chunks: 2·log2 P messages, 2(P-1)/P·S bytes per rank (+ folds).
                                                           2·log2 P·α + 2(P-1)/P·Sβ
  hierarchical        m nodes × k ranks: ring reduce-scatter inside the node, ring all-reduce of
                      my S/k shard with my peers on the other nodes, ring all-gather inside the
                      node (primitives/engine/hierarchical.py). Per rank 2(k-1)/k·S intra-node and only
                      2(m-1)/m·S/k inter-node bytes.
Floating SUM differs from the backend's result only by summation order: each algorithm sums
in a fixed order, and every rank ends with bitwise-identical values.
"""
from __future__ import annotations

from primitives.engine import shm_collectives
from primitives.broadcast import _linear as _bcast_linear
from primitives.reduce import _linear as _reduce_linear
from primitives.engine.core import (Check, LazyFlat, ReduceOp, chunk_bounds, combine_, finish_avg_, fuses, get_comm,
                             resolve, run, scratch, wait_all)
from primitives.engine.envelope import Fused


def _linear(comm, buf, op):
    _reduce_linear(comm, buf, 0, op)
    _bcast_linear(comm, buf, 0)


def _ring(comm, buf, op):
    chunk = [buf[s:e] for s, e in chunk_bounds(buf.numel(), comm.size)]
    _ring_reduce_scatter(comm, chunk, op)
    _ring_all_gather(comm, chunk)


def _ring_reduce_scatter(comm, chunk, op):
    """The ring's first half (also used by primitives/engine/hierarchical.py): rank r ends owning chunk r+1."""
    n, r = comm.size, comm.rank
    tmp = scratch(comm, chunk[0].numel(), chunk[0].dtype, device=chunk[0].device)
    nxt, prev = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                       # reduce-scatter: after it, rank r owns chunk r+1
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        inc = tmp[:chunk[recv_i].numel()]
        # one group per step: at N = 2 prev == nxt, and an ungrouped irecv/isend pair deadlocks on nccl
        wait_all(comm.exchange(sends=[(chunk[send_i], nxt)], recvs=[(inc, prev)]))
        combine_(chunk[recv_i], inc, op)          # the chunk we sent is not touched this step


def _ring_all_gather(comm, chunk):
    """The ring's second half: rank r starts owning chunk r+1 and ends with every chunk."""
    n, r = comm.size, comm.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                       # all-gather: pass finished chunks around
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        wait_all(comm.exchange(sends=[(chunk[send_i], nxt)], recvs=[(chunk[recv_i], prev)]))


def _direct(comm, buf, op):
    n, r = comm.size, comm.rank
    b = chunk_bounds(buf.numel(), n)
    chunk = [buf[s:e] for s, e in b]
    mine = chunk[r]
    tmp = scratch(comm, (n - 1) * mine.numel(), buf.dtype, device=buf.device).view(n - 1, -1)
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(chunk[p], p) for p in peers], recvs=[(tmp[i], p) for i, p in enumerate(peers)]))
    rows = {p: tmp[i] for i, p in enumerate(peers)}
    rows[r] = mine
    acc = scratch(comm, mine.numel(), buf.dtype, slot=1, device=buf.device).copy_(rows[0])
    for p in range(1, n):                            # fixed rank order: every chunk summed alike
        combine_(acc, rows[p], op)
    mine.copy_(acc)
    wait_all(comm.exchange(sends=[(mine, p) for p in peers], recvs=[(chunk[p], p) for p in peers]))


def _reduce_rows(buf, rows, op):
    """buf <- rows[0] op rows[1] op ... in rank order: every rank gets bitwise the same result."""
    acc = rows[0].clone()                            # rows[r] is buf itself
    for p in range(1, len(rows)):
        combine_(acc, rows[p], op)
    buf.copy_(acc)


def _one_shot(comm, buf, op):
    n, r = comm.size, comm.rank
    tmp = scratch(comm, (n - 1) * buf.numel(), buf.dtype, device=buf.device).view(n - 1, -1)
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(buf, p) for p in peers], recvs=[(tmp[i], p) for i, p in enumerate(peers)]))
    rows = {p: tmp[i] for i, p in enumerate(peers)}
    rows[r] = buf
    _reduce_rows(buf, [rows[p] for p in range(n)], op)


def _one_shot_fused(prep, op, n, r, done):
    """The same algorithm, its messages carried by the check's envelopes (core.run)."""
    def finish(got):
        buf = prep()
        nb = buf.numel() * buf.element_size()
        rows = got(nb, buf.dtype)
        rows[r] = buf
        _reduce_rows(buf, [rows[p] for p in range(n)], op)
        done()
        return [nb] * (n - 1)
    return Fused(lambda peer: prep(), finish, same_for_all=True)


def _fold_in(comm, buf, op):
    """Non-power-of-two N: ranks 0,2,..,2R-2 hand their data to their odd neighbour and sit out.
    Returns (my rank among the P survivors or -1, P, function mapping survivor rank -> real rank)."""
    n, r = comm.size, comm.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    real = (lambda nr: 2 * nr + 1 if nr < rem else nr + rem)
    if r < 2 * rem:
        if r % 2 == 0:
            comm.send(buf, r + 1)
            return -1, p, real
        tmp = scratch(comm, buf.numel(), buf.dtype, device=buf.device)
        comm.recv(tmp, r - 1)
        combine_(buf, tmp, op)
        return r // 2, p, real
    return r - rem, p, real


def _fold_out(comm, buf, p):
    rem, r = comm.size - p, comm.rank
    if r < 2 * rem:
        if r % 2 == 0:
            comm.recv(buf, r + 1)
        else:
            comm.send(buf, r - 1)


def _recursive_doubling(comm, buf, op):
    nr, p, real = _fold_in(comm, buf, op)
    if nr >= 0:
        tmp = scratch(comm, buf.numel(), buf.dtype, device=buf.device)
        mask = 1
        while mask < p:
            comm.sendrecv(buf, tmp, real(nr ^ mask))
            combine_(buf, tmp, op)                # a∘b == b∘a bitwise, so both partners agree
            mask <<= 1
    _fold_out(comm, buf, p)


def _rabenseifner(comm, buf, op):
    nr, p, real = _fold_in(comm, buf, op)
    if nr >= 0:
        b = chunk_bounds(buf.numel(), p)
        span = lambda lo, hi: buf[b[lo][0]:b[hi - 1][1]]  # noqa: E731
        tmp = scratch(comm, b[0][1] * ((p + 1) // 2), buf.dtype, device=buf.device)
        steps, lo, hi, mask = [], 0, p, p >> 1
        while mask:                                # recursive halving: keep the half my bit names
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if not nr & mask else ((mid, hi), (lo, mid))
            mine = span(*keep)
            inc = tmp[:mine.numel()]
            comm.sendrecv(span(*give), inc, real(nr ^ mask))
            combine_(mine, inc, op)
            steps.append((keep, give, mask))
            (lo, hi), mask = keep, mask >> 1
        for keep, give, mask in reversed(steps):   # recursive doubling: swap finished halves back
            comm.sendrecv(span(*keep), span(*give), real(nr ^ mask))
    _fold_out(comm, buf, p)


def _hierarchical(comm, buf, op):   # multinode: intra reduce-scatter, inter all-reduce, intra all-gather
    from primitives.engine.hierarchical import all_reduce_2level
    all_reduce_2level(comm, buf, op)


ALGOS = {"linear": _linear, "ring": _ring, "direct": _direct, "one_shot": _one_shot,
         "recursive_doubling": _recursive_doubling, "rabenseifner": _rabenseifner, "hierarchical": _hierarchical,
         "shm": shm_collectives.all_reduce}   # "shm": shm transport only


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_reduce(tensor, op): in place on every rank."""
    comm = get_comm(group)
    check = Check(comm, "all_reduce")
    ok = check.tensor("tensor", tensor)
    opn = check.op(op, tensor.dtype if ok else None)
    nbytes = tensor.numel() * tensor.element_size() if ok else 0
    algo = resolve("all_reduce", algorithm, ALGOS, comm, nbytes, check)

    prep = LazyFlat(tensor)

    def done():
        finish_avg_(prep(), opn, comm.size)
        prep.copy_back()

    def body():
        buf = prep()
        if buf.numel() and comm.size > 1:
            ALGOS[algo](comm, buf, opn)
        done()
    fused = (_one_shot_fused(prep, opn, comm.size, comm.rank, done)
             if ok and tensor.numel() and fuses("all_reduce", algo, comm, nbytes) else None)
    return run(comm, "all_reduce", algo, check, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=opn, root=-1,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               fused=fused)


if __name__ == "__main__":
    from primitives.engine.runner import main
    main("all_reduce")
