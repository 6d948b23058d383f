"""Collectives that read peers' buffers in shared memory directly (algorithm="shm"), the
way MPICH's intranode collectives and DeepSpeed's CPU shm op (shm.cpp) do. Only when every
rank of the group is on this host (ShmComm.transport == "shm"); `auto` picks them by cost.py.

    RINGZERO_TRANSPORT=shm torchrun --nproc_per_node 4 primitives/engine/bench.py --ops all_reduce --algorithms shm

Each rank owns BUFS = 3 workspaces of W bytes (RINGZERO_SHM_WORKSPACE, 2 MiB: a round's
working set stays in cache; benchmarks/shm_profile.py measured the copies and adds of 64 MiB
~4x faster in 2 MiB rounds than in 16 MiB ones) used in turn; ranks meet through flags, not
messages or barriers (shm_flags.py, which also carries the call's check in the workspace
header). Three buffers
make ONE flag per round enough: I rewrite buffer i only after every peer published a flag it
raises after its last read of buffer i-3. Views of the workspaces are cached: no allocation.

  all_reduce (S > ONE_SHOT_BYTES), rounds j = 0..R-1 of C = W bytes, slot p of round j =
  chunk_bounds(C, N)[p] (rank p reduces it), reduction in rank order 0..N-1:
      copy-in(0); publish
      for j: wait; reduce slot r of round j from all N workspaces (mine from my tensor) into
             my workspace and my tensor; copy-out(j-1) (the others' slots); copy-in(j+1); publish
      wait; copy-out(R-1)
    R+1 flags. Per rank: copy (N-1)/N·S in, (N-1)/N·S out, reduce S/N from N sources, S/N copied
    to my tensor. T ≈ (R+1)·α + (2N-1)/N·S·c + (N-1)/N·S·γ  (c: seconds per byte copied,
    R = ⌈S/W⌉). Peers read (N-1)/N·S of my input and (N-1)/N·S of my result: the ledger counts
    2(N-1)/N·S sent, what "direct" sends.
  all_reduce (S ≤ ONE_SHOT_BYTES, 256 KiB): copy all of it in, one flag, every rank reduces all N
    in rank order. T ≈ α + S·c + (N-1)·S·γ; peers read (N-1)·S of mine.
  all_gather: per round copy my block in, flag, copy the N-1 others out: T ≈ R·α + N·s·c.
  reduce_scatter: per round copy in the N-1 blocks others own, flag, reduce mine from all N:
    T ≈ R·α + N·s·c + (N-1)·s·γ (s = one block; R = ⌈s/W⌉ all-gather, ⌈N·s/W⌉ reduce-scatter).

Reference order of every reduction: rank order, ((x0 op x1) op x2) op ..., each step rounded
to the dtype; AVG divides that sum once (tests/test_shm_collectives.py checks the bits).
"""
from __future__ import annotations

import torch

from primitives.engine.ledger import LEDGER
from primitives.engine.shm_flags import checked, next_buf, publish, state, wait  # noqa: F401  (core.run: checked)
from primitives.engine.shm_segment import BUFS, WS_BYTES
from primitives.ops import chunk_bounds, combine_

ONE_SHOT_BYTES = min(WS_BYTES, 256 << 10)   # all-reduce up to this: one flag, N·S reduced per rank

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


def _all_reduce_one_shot(comm, st, buf, op):
    n, r, k = comm.size, comm.rank, buf.numel()
    b = next_buf(st)
    st.view(r, b, buf.dtype)[:k].copy_(buf)
    publish(comm, st, b)
    wait(comm, st, "all_reduce: waiting for", b)
    _reduce(buf, [st.view(p, b, buf.dtype)[:k] for p in range(n)], op)
    S = k * buf.element_size()
    _count([S] * (n - 1), [S] * (n - 1))


def all_reduce(comm, buf, op):
    st = state(comm)
    n, r, esz, k = comm.size, comm.rank, buf.element_size(), buf.numel()
    if k * esz <= ONE_SHOT_BYTES:
        return _all_reduce_one_shot(comm, st, buf, op)
    C = max(n, WS_BYTES // esz)                     # elements per round
    R, base, dt = -(-k // C), st.gen, buf.dtype
    st.gen += 1                                     # the first buffer; the rest once past the check
    rounds = []
    for j in range(R):
        c0, c1 = j * C, min(k, (j + 1) * C)
        rounds.append((c0, chunk_bounds(c1 - c0, n), c1 - c0, (base + j) % BUFS))

    def copy_in(j):
        c0, bd, w, b = rounds[j]
        s, e = bd[r]
        mine = st.view(r, b, dt)
        if s:
            mine[:s].copy_(buf[c0:c0 + s])
        if e < w:
            mine[e:w].copy_(buf[c0 + e:c0 + w])

    def copy_out(j):
        c0, bd, w, b = rounds[j]
        for p in st.peers:
            s, e = bd[p]
            if e > s:
                buf[c0 + s:c0 + e].copy_(st.view(p, b, dt)[s:e])

    copy_in(0)
    publish(comm, st, base % BUFS)
    for j in range(R):
        wait(comm, st, "all_reduce: waiting for", base % BUFS if j == 0 else None)
        st.gen = base + R
        c0, bd, w, b = rounds[j]
        s, e = bd[r]
        if e > s:
            acc = st.view(r, b, dt)[s:e]
            _reduce(acc, [buf[c0 + s:c0 + e] if p == r else st.view(p, b, dt)[s:e] for p in range(n)], op)
            buf[c0 + s:c0 + e].copy_(acc)
        if j:
            copy_out(j - 1)
        if j + 1 < R:
            copy_in(j + 1)
        publish(comm, st)
    wait(comm, st, "all_reduce: waiting for")
    copy_out(R - 1)
    c = [(e - s) * esz for s, e in chunk_bounds(k, n)]
    _count([c[p] for p in st.peers] + [c[r]] * (n - 1), [c[r]] * (n - 1) + [c[p] for p in st.peers])


def all_gather(comm, blocks):
    st = state(comm)
    n, r = comm.size, comm.rank
    k, dt = blocks[r].numel(), blocks[r].dtype
    m = max(1, WS_BYTES // blocks[r].element_size())
    for c0 in range(0, k, m):
        c1 = min(k, c0 + m)
        b = next_buf(st)
        st.view(r, b, dt)[:c1 - c0].copy_(blocks[r][c0:c1])
        publish(comm, st, b)
        wait(comm, st, "all_gather: waiting for", b)
        for p in st.peers:
            blocks[p][c0:c1].copy_(st.view(p, b, dt)[:c1 - c0])
    S = k * blocks[r].element_size()
    _count([S] * (n - 1), [S] * (n - 1))


def reduce_scatter(comm, blocks, out, op):
    st = state(comm)
    n, r = comm.size, comm.rank
    k, dt = out.numel(), out.dtype
    m = max(1, WS_BYTES // out.element_size() // n)
    for c0 in range(0, k, m):
        c1 = min(k, c0 + m)
        w = c1 - c0
        b = next_buf(st)
        mine = st.view(r, b, dt)
        for p in st.peers:
            mine[p * m:p * m + w].copy_(blocks[p][c0:c1])
        publish(comm, st, b)
        wait(comm, st, "reduce_scatter: waiting for", b)
        acc = mine[r * m:r * m + w]                    # my own block's slot is free: out may alias blocks[r]
        _reduce(acc, [blocks[r][c0:c1] if p == r else st.view(p, b, dt)[r * m:r * m + w] for p in range(n)], op)
        out[c0:c1].copy_(acc)
    S = k * out.element_size()
    _count([S] * (n - 1), [S] * (n - 1))
