"""Reduce-scatter from point-to-point: rank r ends with block r of the elementwise op over
every rank's N-block input.

    torchrun --nproc_per_node 4 primitives/reducescatter.py  (verify and time every algorithm)
    mpiexec -n 4 python primitives/reducescatter.py --backend mpi

Cost, S = bytes of one block (each input holds N·S):
  linear  reduce every whole input to rank 0, which sends each rank its block.
          Non-root ranks send N·S; rank 0 sends (N-1)·S.  (N-1)(α + NSβ + NSγ) + (N-1)(α + Sβ)
  ring    N-1 steps; at step s rank r adds its own block (r-s-2) to the partial sum it just
          received and passes it on. N-1 messages, (N-1)·S bytes per rank.
                                                           (N-1)(α + Sβ + Sγ)
  direct  one round: rank r sends block p to rank p and receives block r from everyone at
          once, then reduces the N contributions in rank order 0..N-1. N-1 messages,
          (N-1)·S bytes per rank; (N-1)·S bytes of scratch.  α + (N-1)·o + (N-1)S(β + γ)
  hierarchical  across m nodes × k ranks: intra rings per node, then an inter ring of the partial
          sums (primitives/engine/subcomm.py); m(k-1)·S intra-node and (m-1)·S inter-node bytes per rank.
The engine's checked call carries direct's blocks (≤ 64 KiB each) inside its check round.
The caller's input is never modified (two block-sized scratch buffers, used in turn, so a
buffer is never overwritten while its send is in flight; one at N = 2, which has one step).
"""
from primitives.ops import combine_, wait_all
from primitives.reduce import linear as reduce_linear


def linear(comm, blocks, out, op):
    n, r = comm.size, comm.rank
    s = blocks[0].numel()
    work = comm.scratch(n * s, out.dtype, slot=2, device=out.device)
    for i, b in enumerate(blocks):                   # pack (and protect the caller's input)
        work[i * s:(i + 1) * s].copy_(b)
    reduce_linear(comm, work, 0, op)
    if r == 0:
        wait_all([comm.isend(work[p * s:(p + 1) * s], p) for p in range(1, n)])
        out.copy_(work[:s])
    else:
        comm.recv(out, 0)


def ring(comm, blocks, out, op):
    n, r = comm.size, comm.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    slots = [comm.scratch(out.numel(), out.dtype, slot=i, device=out.device) for i in range(min(2, n - 1))]
    send = blocks[(r - 1) % n]
    for s in range(n - 1):                        # one group per step (prev == nxt at N = 2)
        inc = slots[s % 2]                         # never the slot whose send is in this group
        wait_all(comm.exchange(sends=[(send, nxt)], recvs=[(inc, prev)]))
        combine_(inc, blocks[(r - s - 2) % n], op)
        send = inc
    out.copy_(inc)


def direct(comm, blocks, out, op):
    n, r, k = comm.size, comm.rank, out.numel()
    tmp = comm.scratch((n - 1) * k, out.dtype, device=out.device).view(n - 1, k)
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(blocks[p], p) for p in peers], recvs=[(tmp[i], p) for i, p in enumerate(peers)]))
    rows = {p: tmp[i] for i, p in enumerate(peers)}
    rows[r] = blocks[r]
    acc = comm.scratch(k, out.dtype, slot=1, device=out.device).copy_(rows[0])   # out may alias blocks[r]
    for p in range(1, n):                            # fixed rank order: deterministic
        combine_(acc, rows[p], op)
    out.copy_(acc)
