"""All-gather from point-to-point: every rank ends with every rank's tensor, in rank order.

    torchrun --nproc_per_node 4 primitives/allgather.py      (verify and time every algorithm)
    mpiexec -n 4 python primitives/allgather.py --backend mpi

Cost, S = bytes each rank contributes (the output holds N·S):
  linear  gather to rank 0, which then sends each rank the N-1 blocks it lacks.
          Rank 0 sends (N-1)² messages, (N-1)²·S bytes; the others send S once.
  ring    N-1 steps; at step s rank r passes block (r-s) on to r+1.
          N-1 messages, (N-1)·S bytes per rank.           (N-1)(α + Sβ)
  direct  one round: every rank posts a receive from, and a send of its block to, every
          other rank at once (staggered r+1, r+2, … so nobody is everyone's first peer).
          Same bytes as the ring, N-1 messages, but no step waits for another: on an
          oversubscribed host that is what matters.       α + (N-1)·o + (N-1)Sβ
  hierarchical  across m nodes × k ranks: inter ring, then intra rings (primitives/engine/subcomm.py);
          (m-1)·S inter-node and m(k-1)·S intra-node bytes per rank.
The engine's checked call carries direct's blocks (≤ 64 KiB each) inside its check round.
"""
from primitives.ops import wait_all


def linear(comm, blocks):
    n, r = comm.size, comm.rank
    if r == 0:
        wait_all([comm.irecv(blocks[p], p) for p in range(1, n)])
        wait_all([comm.isend(blocks[i], p) for p in range(1, n) for i in range(n) if i != p])
    else:
        comm.send(blocks[r], 0)
        wait_all([comm.irecv(blocks[i], 0) for i in range(n) if i != r])


def ring(comm, blocks):
    n, r = comm.size, comm.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                        # one group per step (prev == nxt at N = 2)
        wait_all(comm.exchange(sends=[(blocks[(r - s) % n], nxt)], recvs=[(blocks[(r - s - 1) % n], prev)]))


def direct(comm, blocks):
    n, r = comm.size, comm.rank
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(blocks[r], p) for p in peers], recvs=[(blocks[p], p) for p in peers]))
