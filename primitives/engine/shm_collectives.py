"""algorithm="shm": the textbook's shared-memory collectives (primitives/shm.py) on this
host's segment (shm_flags.py: flags, futex doorbells, the check in the workspace header),
with their bytes in the ledger. Only when every rank of the group is on this host
(ShmComm.transport == "shm"); `auto` picks them by cost.py.

    RINGZERO_TRANSPORT=shm torchrun --nproc_per_node 4 benchmarks/collectives.py --ops all_reduce --algorithms shm

Each rank owns BUFS = 3 workspaces of W bytes (RINGZERO_SHM_WORKSPACE, 2 MiB: a round's working
set stays in cache; benchmarks/shm_profile.py measured the copies and adds of 64 MiB ~4x faster
in 2 MiB rounds than in 16 MiB ones). The ledger counts what peers read of mine: one-shot
(N-1)·S, by slices 2(N-1)/N·S (what "direct" sends), all-gather / reduce-scatter (N-1)·s.
"""
from __future__ import annotations

from primitives import shm
from primitives.engine.ledger import LEDGER
from primitives.engine.shm_flags import checked, state  # noqa: F401  (core.run: checked)
from primitives.engine.shm_segment import WS_BYTES
from primitives.ops import chunk_bounds

ONE_SHOT_BYTES = min(WS_BYTES, shm.ONE_SHOT_BYTES)


def _count(sent: list[int], recv: list[int]) -> None:
    for b in sent:
        if b:
            LEDGER.sent(b)
    for b in recv:
        if b:
            LEDGER.received(b)


def all_reduce(comm, buf, op):
    st = state(comm)
    n, r, S = comm.size, comm.rank, buf.numel() * buf.element_size()
    if S <= ONE_SHOT_BYTES:                       # fits the real workspace (st.W may be set smaller)
        shm.shm_one_shot(st, buf, op)
        return _count([S] * (n - 1), [S] * (n - 1))
    shm.shm_reduce_by_slices(st, buf, op)
    c = [(e - s) * buf.element_size() for s, e in chunk_bounds(buf.numel(), n)]
    _count([c[p] for p in st.peers] + [c[r]] * (n - 1), [c[r]] * (n - 1) + [c[p] for p in st.peers])


def all_gather(comm, blocks):
    shm.shm_all_gather(state(comm), blocks)
    S = blocks[comm.rank].numel() * blocks[comm.rank].element_size()
    _count([S] * (comm.size - 1), [S] * (comm.size - 1))


def reduce_scatter(comm, blocks, out, op):
    shm.shm_reduce_scatter(state(comm), blocks, out, op)
    S = out.numel() * out.element_size()
    _count([S] * (comm.size - 1), [S] * (comm.size - 1))
