"""All-reduce from point-to-point: every rank ends with the elementwise op over all tensors.

    torchrun --nproc_per_node 4 primitives/allreduce.py      (verify and time every algorithm)
    mpiexec -n 4 python primitives/allreduce.py --backend mpi

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
                      step. The engine's checked call carries a call of ≤ 64 KiB this way
                      inside its check round (primitives/engine/envelope.py).
                                                           α + (N-2)·o + (N-1)·S(β + γ)
  recursive_doubling  log2 P exchanges of the whole buffer with rank ^ 2^k (+1 fold message
                      before and after when N is not a power of two). log2 P·S per rank.
                                                           log2 P·(α + Sβ + Sγ)
  rabenseifner        recursive halving reduce-scatter, then recursive doubling all-gather,
                      over P chunks: 2·log2 P messages, 2(P-1)/P·S bytes per rank (+ folds).
                                                           2·log2 P·α + 2(P-1)/P·Sβ
(primitives/engine/subcomm.py builds the two-level all-reduce of m nodes from
ring_reduce_scatter and ring_all_gather below.)
Floating SUM differs from the backend's result only by summation order: each algorithm sums
in a fixed order, and every rank ends with bitwise-identical values.
"""
from primitives.broadcast import linear as _bcast_linear
from primitives.ops import chunk_bounds, combine_, wait_all
from primitives.reduce import linear as _reduce_linear


def linear(comm, buf, op):
    """Reduce to rank 0, broadcast back."""
    _reduce_linear(comm, buf, 0, op)
    _bcast_linear(comm, buf, 0)


def ring(comm, buf, op):
    """Ring all-reduce = ring reduce-scatter + ring all-gather over N chunks of buf."""
    chunk = [buf[s:e] for s, e in chunk_bounds(buf.numel(), comm.size)]
    ring_reduce_scatter(comm, chunk, op)
    ring_all_gather(comm, chunk)


def ring_reduce_scatter(comm, chunk, op):
    """The ring's first half: N-1 steps; rank r ends owning chunk r+1, summed over all ranks."""
    n, r = comm.size, comm.rank
    tmp = comm.scratch(chunk[0].numel(), chunk[0].dtype, device=chunk[0].device)
    nxt, prev = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        inc = tmp[:chunk[recv_i].numel()]
        # one group per step: at N = 2 prev == nxt, and an ungrouped irecv/isend pair deadlocks on nccl
        wait_all(comm.exchange(sends=[(chunk[send_i], nxt)], recvs=[(inc, prev)]))
        combine_(chunk[recv_i], inc, op)          # the chunk we sent is not touched this step


def ring_all_gather(comm, chunk):
    """The ring's second half: rank r starts owning chunk r+1 and ends with every chunk."""
    n, r = comm.size, comm.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                       # pass finished chunks around
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        wait_all(comm.exchange(sends=[(chunk[send_i], nxt)], recvs=[(chunk[recv_i], prev)]))


def direct(comm, buf, op):
    """Reduce-scatter and all-gather, each one round in which every rank talks to every other."""
    n, r = comm.size, comm.rank
    b = chunk_bounds(buf.numel(), n)
    chunk = [buf[s:e] for s, e in b]
    mine = chunk[r]
    tmp = comm.scratch((n - 1) * mine.numel(), buf.dtype, device=buf.device).view(n - 1, -1)
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(chunk[p], p) for p in peers], recvs=[(tmp[i], p) for i, p in enumerate(peers)]))
    rows = {p: tmp[i] for i, p in enumerate(peers)}
    rows[r] = mine
    acc = comm.scratch(mine.numel(), buf.dtype, slot=1, device=buf.device).copy_(rows[0])
    for p in range(1, n):                            # fixed rank order: every chunk summed alike
        combine_(acc, rows[p], op)
    mine.copy_(acc)
    wait_all(comm.exchange(sends=[(mine, p) for p in peers], recvs=[(chunk[p], p) for p in peers]))


def reduce_rows(buf, rows, op):
    """buf <- rows[0] op rows[1] op ... in rank order: every rank gets bitwise the same result."""
    acc = rows[0].clone()                            # rows[r] is buf itself
    for p in range(1, len(rows)):
        combine_(acc, rows[p], op)
    buf.copy_(acc)


def one_shot(comm, buf, op):
    """Everyone sends the whole buffer to everyone in one round; each reduces all N in rank order."""
    n, r = comm.size, comm.rank
    tmp = comm.scratch((n - 1) * buf.numel(), buf.dtype, device=buf.device).view(n - 1, -1)
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(buf, p) for p in peers], recvs=[(tmp[i], p) for i, p in enumerate(peers)]))
    rows = {p: tmp[i] for i, p in enumerate(peers)}
    rows[r] = buf
    reduce_rows(buf, [rows[p] for p in range(n)], op)


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
        tmp = comm.scratch(buf.numel(), buf.dtype, device=buf.device)
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


def recursive_doubling(comm, buf, op):
    """log2 P exchanges of the whole buffer with rank XOR 2^k."""
    nr, p, real = _fold_in(comm, buf, op)
    if nr >= 0:
        tmp = comm.scratch(buf.numel(), buf.dtype, device=buf.device)
        mask = 1
        while mask < p:
            comm.sendrecv(buf, tmp, real(nr ^ mask))
            combine_(buf, tmp, op)                # a∘b == b∘a bitwise, so both partners agree
            mask <<= 1
    _fold_out(comm, buf, p)


def rabenseifner(comm, buf, op):
    """Recursive halving reduce-scatter, then recursive doubling all-gather (Rabenseifner 2004)."""
    nr, p, real = _fold_in(comm, buf, op)
    if nr >= 0:
        b = chunk_bounds(buf.numel(), p)
        span = lambda lo, hi: buf[b[lo][0]:b[hi - 1][1]]  # noqa: E731
        tmp = comm.scratch(b[0][1] * ((p + 1) // 2), buf.dtype, device=buf.device)
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
