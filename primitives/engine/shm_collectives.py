"""Collectives that read peers' buffers in shared memory directly (algorithm="shm"), the
way MPICH's intranode collectives and DeepSpeed's CPU shm op do. Only when every rank of the
group is on this host (ShmComm.transport == "shm"); `auto` picks them by the cost model.

    RINGZERO_TRANSPORT=shm torchrun --nproc_per_node 4 primitives/allreduce.py

Each rank owns a workspace of W = 8 MiB (RINGZERO_SHM_WORKSPACE), two of them used in turn so
that one barrier per round is enough: rank r rewrites buffer g%2 only after every rank has
passed the barrier of round g-1, i.e. finished reading round g-2 from it.

  all_reduce      rank r copies every slice but its own into its workspace (barrier), adds slice
                  r from all N workspaces (its own straight from its tensor) in rank order 0..N-1
                  into its workspace and its tensor (barrier), then copies the others' finished
                  slices out. Per rank: 2(N-1)/N·S copied + N·S/N reduced; 2 barriers per round.
                  Peers read (N-1)/N·S of my input and (N-1)·S/N of my result: 2(N-1)/N·S,
                  what the ledger counts as sent — the same as "direct" (and the ring's total).
                  Up to ONE_SHOT_BYTES (64 KiB) instead: publish all of it (barrier), every rank
                  reduces all N in rank order. One barrier; peers read (N-1)·S of mine.
  all_gather      copy my block in (barrier), copy the N-1 others out. Ledger: (N-1)·S sent.
  reduce_scatter  copy the N-1 blocks others own in (barrier), reduce mine in rank order from
                  all workspaces. Ledger: (N-1)·S sent (S = one block).
Buffers larger than the workspace go in rounds: ⌈slice/(W/N)⌉ for all-reduce, ⌈S/W⌉ and
⌈S/(W/N)⌉ for all-gather and reduce-scatter. Cost per round: one barrier (α_shm) each phase.
"""
from __future__ import annotations

import torch

from primitives.engine.ledger import LEDGER
from primitives.engine.shm_segment import WS_BYTES
from primitives.ops import chunk_bounds, combine_

ONE_SHOT_BYTES = min(WS_BYTES, 64 << 10)   # all-reduce up to this: one barrier, N·S reduced per rank

_FIRST = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}


def _reduce(acc, srcs, op):
    """acc <- srcs[0] op srcs[1] op ... in that order (one pass fewer than copy-then-combine)."""
    if len(srcs) == 1:
        acc.copy_(srcs[0])
        return
    _FIRST[op](srcs[0], srcs[1], out=acc)
    for s in srcs[2:]:
        combine_(acc, s, op)


def _count(sent: list[int], recv: list[int]) -> None:
    for b in sent:
        if b:
            LEDGER.sent(b)
    for b in recv:
        if b:
            LEDGER.received(b)


def _elems(buf) -> int:
    return WS_BYTES // buf.element_size()


def _all_reduce_one_shot(comm, buf, op):
    """Small buffers: everyone publishes the whole buffer (barrier), then every rank reduces all
    of it from the N workspaces in rank order: one barrier instead of two, same bits everywhere."""
    n, r = comm.size, comm.rank
    g = comm.ws_gen = comm.ws_gen + 1
    ws = [comm.workspace(p, g, buf.dtype, buf.numel()) for p in range(n)]
    ws[r].copy_(buf)
    comm.barrier_local("all_reduce")
    _reduce(buf, ws, op)
    S = buf.numel() * buf.element_size()
    _count([S] * (n - 1), [S] * (n - 1))


def all_reduce(comm, buf, op):
    n, r, esz = comm.size, comm.rank, buf.element_size()
    if buf.numel() * esz <= ONE_SHOT_BYTES:
        return _all_reduce_one_shot(comm, buf, op)
    b = chunk_bounds(buf.numel(), n)
    m = max(1, _elems(buf) // n)                       # elements of each slice per round
    rounds = -(-max(e - s for s, e in b) // m)
    for j in range(rounds):
        g = comm.ws_gen = comm.ws_gen + 1
        piece = [(min(s + j * m, e), min(s + (j + 1) * m, e)) for s, e in b]   # slice p, round j
        ws = [comm.workspace(p, g, buf.dtype, n * m) for p in range(n)]
        mine = ws[r]
        for p, (s, e) in enumerate(piece):
            if p != r and e > s:
                mine[p * m:p * m + e - s].copy_(buf[s:e])
        comm.barrier_local("all_reduce")
        s, e = piece[r]
        if e > s:
            acc = mine[r * m:r * m + e - s]
            _reduce(acc, [buf[s:e] if p == r else ws[p][r * m:r * m + e - s] for p in range(n)], op)
            buf[s:e].copy_(acc)
        comm.barrier_local("all_reduce")
        for p, (s, e) in enumerate(piece):
            if p != r and e > s:
                buf[s:e].copy_(ws[p][p * m:p * m + e - s])
    c = [(e - s) * esz for s, e in b]
    _count([c[p] for p in range(n) if p != r] + [c[r]] * (n - 1),
           [c[r]] * (n - 1) + [c[p] for p in range(n) if p != r])


def all_gather(comm, blocks):
    n, r = comm.size, comm.rank
    k, m = blocks[r].numel(), _elems(blocks[r])
    for c0 in range(0, k, m):
        c1 = min(k, c0 + m)
        g = comm.ws_gen = comm.ws_gen + 1
        comm.workspace(r, g, blocks[r].dtype, c1 - c0).copy_(blocks[r][c0:c1])
        comm.barrier_local("all_gather")
        for p in range(n):
            if p != r:
                blocks[p][c0:c1].copy_(comm.workspace(p, g, blocks[p].dtype, c1 - c0))
    S = k * blocks[r].element_size()
    _count([S] * (n - 1), [S] * (n - 1))


def reduce_scatter(comm, blocks, out, op):
    n, r = comm.size, comm.rank
    k, m = out.numel(), max(1, _elems(out) // n)
    for c0 in range(0, k, m):
        c1 = min(k, c0 + m)
        w = c1 - c0
        g = comm.ws_gen = comm.ws_gen + 1
        ws = [comm.workspace(p, g, out.dtype, n * m) for p in range(n)]
        for p in range(n):
            if p != r:
                ws[r][p * m:p * m + w].copy_(blocks[p][c0:c1])
        comm.barrier_local("reduce_scatter")
        acc = ws[r][r * m:r * m + w]                    # my own block's slot is free: out may alias blocks[r]
        _reduce(acc, [blocks[r][c0:c1] if p == r else ws[p][r * m:r * m + w] for p in range(n)], op)
        out[c0:c1].copy_(acc)
    S = k * out.element_size()
    _count([S] * (n - 1), [S] * (n - 1))
