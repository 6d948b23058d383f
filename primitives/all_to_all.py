"""All-to-all from point-to-point: rank r's block p goes to rank p, which stores it as block r.

    torchrun --nproc_per_node 4 primitives/run.py all_to_all
    mpiexec -n 4 python primitives/run.py all_to_all --backend mpi

send[p] / recv[p] are the blocks for / from rank p; they may differ in size (uneven splits).
Split sizes count rows of dim 0 (None = dim 0 divided evenly by N), so blocks may be uneven.
It is the transpose of a distributed N×N matrix of blocks: what Ulysses sequence parallelism
uses to turn "my sequence slice, every head" into "every position, my heads"
(tensor_parallel/engine/ulysses.py).

Cost, S_p = bytes this rank sends to rank p (even splits: S_p = S/N, S = this rank's input):
  linear    one round: post every receive and every send at once (Open MPI's "basic linear"),
            staggered r+1, r+2, … so nobody is everyone's first peer.
            N-1 messages, Σ_{p≠r} S_p bytes per rank.      α + (N-2)·o + (N-1)/N·S·β
  pairwise  N-1 steps; at step s rank r sends to r+s and receives from r-s (Open MPI's
            "pairwise exchange"): at most one message in flight each way, so no receiver is
            flooded.  Same messages and bytes.              (N-1)(α + S/N·β)
Every byte but the local block crosses the wire once, so busbw = algbw·(N-1)/N.
"""
from primitives.ops import wait_all


def linear(comm, send, recv):
    n, r = comm.size, comm.rank
    peers = [(r + i) % n for i in range(1, n)]
    # one group: on nccl, receives posted before their sends outside a group would deadlock
    wait_all(comm.exchange(sends=[(send[p], p) for p in peers], recvs=[(recv[p], p) for p in peers]))


def pairwise(comm, send, recv):
    n, r = comm.size, comm.rank
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        wait_all(comm.exchange(sends=[(send[to], to)], recvs=[(recv[frm], frm)]))
