"""Collectives over a shared-memory segment: ranks on one host read each other's buffers
instead of sending messages (MPICH's intranode collectives, DeepSpeed's shm.cpp).

    RINGZERO_TRANSPORT=shm torchrun --nproc_per_node 4 primitives/allreduce.py

The segment (built over /dev/shm by primitives/engine/shm_collectives.py) gives every rank BUFS = 3
workspaces of W bytes and one flag:
    seg.rank, seg.size, seg.W        my rank, ranks on the segment, bytes per workspace
    seg.view(p, b, dtype, i=0, j=None)  elements i:j of rank p's workspace b as dtype; every rank may read it
    seg.items(p, b, fmt)             the same workspace as a memoryview of items ("f": float32, "d": float64)
    seg.next_buf(k=1)                the first of the next k workspaces (they are used in turn)
    seg.publish(b=None)              raise my flag: what I wrote so far is readable
    seg.wait(b=None)                 until every peer raised its flag as often as I did
(b names a call's first workspace: the engine's check rides in its header.) Three workspaces
make ONE flag per round enough: I rewrite workspace i only after every peer raised a flag it
raises after its last read of workspace i-3. No message, no barrier, no allocation per call.

Cost for S bytes on N ranks; α: one flag, c: seconds per byte copied, γ: per byte reduced:
  shm_one_shot          copy S in, one flag, every rank reduces all N buffers in rank order.
                        T ≈ α + S·c + (N-1)·S·γ; peers read (N-1)·S of mine. A few floats (buf a
                        memoryview): the same steps item by item, ~0.1 µs an op where a torch op costs µs.
  shm_reduce_by_slices  rounds of W bytes; in round j rank p reduces slice p (chunk_bounds) from
                        all N workspaces into its own, peers copy the reduced slices out one
                        round later. R+1 flags, R = ⌈S/W⌉; per rank (N-1)/N·S copied in and out,
                        S/N reduced from N sources: T ≈ (R+1)·α + (2N-1)/N·S·c + (N-1)/N·S·γ;
                        peers read 2(N-1)/N·S of mine, what "direct" sends. Each rank writes 2S, the
                        least private buffers allow (copying all S in and out writes S/N more).
  shm_all_gather        per round: my block in, a flag, the N-1 others out. T ≈ R·α + N·s·c.
  shm_reduce_scatter    per round: the N-1 blocks others own in, a flag, mine reduced from all N.
                        T ≈ R·α + N·s·c + (N-1)·s·γ   (s = one block).
Every reduction runs in rank order, ((x0 op x1) op x2) op ..., so every rank gets the same bits.
"""
import torch

from primitives.ops import chunk_bounds, combine_

ONE_SHOT_BYTES = 256 << 10   # all-reduce up to this (and W) in one shot: one flag, N·S reduced per rank
#                              (N = 2: the same 2S written as by slices, one flag fewer: up to W there)
_FIRST = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}
COMMUTES = ("sum", "avg", "product", "band", "bor", "bxor")   # x1 op x0 has the bits of x0 op x1 (min(-0, 0) not)
# a float op on items: exact in double, rounded to the item's type when stored: the bits of torch's op
ITEM_OPS = {"sum": float.__add__, "avg": float.__add__, "product": float.__mul__}


def reduce_in_order(acc, srcs, op):
    """acc <- srcs[0] op srcs[1] op ... in that order (the first op writes acc: one pass fewer). acc may
    be srcs[0], or srcs[1] when op commutes: then every op is in place, ~1.3-1.6x faster than out=."""
    first = 2
    if acc is srcs[0]:
        first = 1
    elif len(srcs) > 1 and acc is srcs[1] and op in COMMUTES:
        combine_(acc, srcs[0], op)
    elif len(srcs) == 1 or op not in _FIRST:
        acc.copy_(srcs[0])
        first = 1
    else:
        _FIRST[op](srcs[0], srcs[1], out=acc)
    for s in srcs[first:]:
        combine_(acc, s, op)


def _in_place(r, op):
    """Whether rank r can reduce into its own tensor (it is the first source, or the second and op commutes)."""
    return r == 0 or (r == 1 and op in COMMUTES)


def shm_one_shot(seg, buf, op):
    """Copy mine in, raise my flag, wait for everyone's, reduce all N workspaces into buf (a tensor,
    or a few floats' memoryview: then item by item, each store rounding as torch's op does)."""
    if isinstance(buf, memoryview):
        k, b, f = len(buf), seg.next_buf(), ITEM_OPS[op]
        seg.items(seg.rank, b, buf.format)[:k] = buf
        seg.publish(b)
        seg.wait(b)
        srcs = [seg.items(p, b, buf.format) for p in range(seg.size)]
        for i in range(k):
            buf[i] = srcs[0][i]
            for s in srcs[1:]:
                buf[i] = f(buf[i], s[i])
        return
    k, b = buf.numel(), seg.next_buf()
    seg.view(seg.rank, b, buf.dtype, 0, k).copy_(buf)
    seg.publish(b)
    seg.wait(b)
    me = seg.rank if _in_place(seg.rank, op) else -1          # its own source is buf itself
    reduce_in_order(buf, [buf if p == me else seg.view(p, b, buf.dtype, 0, k) for p in range(seg.size)], op)


def shm_reduce_by_slices(seg, buf, op):
    """Rounds of W bytes; round j: reduce my slice from every workspace, copy the others' reduced
    slices of round j-1 out and my input of round j+1 in, then one flag."""
    n, r, k, dt = seg.size, seg.rank, buf.numel(), buf.dtype
    C = max(n, seg.W // buf.element_size())             # elements per round
    R, b0 = -(-k // C), seg.next_buf()                  # the rest are claimed once past the check
    rounds = [(j * C, chunk_bounds(min(k, (j + 1) * C) - j * C, n), (b0 + j) % 3) for j in range(R)]

    def copy_in(j):                                      # my input, except my own slice (read in place)
        c0, bd, b = rounds[j]
        (s, e), w = bd[r], bd[-1][1]
        seg.view(r, b, dt, 0, s).copy_(buf[c0:c0 + s])
        seg.view(r, b, dt, e, w).copy_(buf[c0 + e:c0 + w])

    def copy_out(j):                                     # the others' reduced slices
        c0, bd, b = rounds[j]
        for p, (s, e) in enumerate(bd):
            if p != r:
                buf[c0 + s:c0 + e].copy_(seg.view(p, b, dt, s, e))

    copy_in(0)
    seg.publish(b0)
    for j, (c0, bd, b) in enumerate(rounds):
        seg.wait(b0 if j == 0 else None)
        if j == 0:
            seg.next_buf(R - 1)
        s, e = bd[r]
        mine, ws = buf[c0 + s:c0 + e], seg.view(r, b, dt, s, e)
        acc, out = (mine, ws) if _in_place(r, op) else (ws, mine)     # the peers read my slice from ws
        reduce_in_order(acc, [mine if p == r else seg.view(p, b, dt, s, e) for p in range(n)], op)
        out.copy_(acc)
        if j:
            copy_out(j - 1)
        if j + 1 < R:
            copy_in(j + 1)
        seg.publish()
    seg.wait()
    copy_out(R - 1)


def shm_all_gather(seg, blocks):
    """blocks[p] <- rank p's blocks[p], W bytes a round: mine in, a flag, the others out."""
    r, dt = seg.rank, blocks[seg.rank].dtype
    k, m = blocks[r].numel(), max(1, seg.W // blocks[r].element_size())
    for c0 in range(0, k, m):
        c1, b = min(k, c0 + m), seg.next_buf()
        seg.view(r, b, dt, 0, c1 - c0).copy_(blocks[r][c0:c1])
        seg.publish(b)
        seg.wait(b)
        for p in range(seg.size):
            if p != r:
                blocks[p][c0:c1].copy_(seg.view(p, b, dt, 0, c1 - c0))


def shm_reduce_scatter(seg, blocks, out, op):
    """out <- blocks[me] reduced over all ranks: per round the blocks others own go in (slot p of
    my workspace for rank p), a flag, then mine reduced from slot me of every workspace."""
    n, r, k, dt = seg.size, seg.rank, out.numel(), out.dtype
    m = max(1, seg.W // out.element_size() // n)
    for c0 in range(0, k, m):
        c1, b = min(k, c0 + m), seg.next_buf()
        w, mine = c1 - c0, seg.view(r, b, dt)
        for p in range(n):
            if p != r:
                mine[p * m:p * m + w].copy_(blocks[p][c0:c1])
        seg.publish(b)
        seg.wait(b)
        acc = mine[r * m:r * m + w]                      # my own slot is free: out may alias blocks[r]
        reduce_in_order(acc, [blocks[r][c0:c1] if p == r else seg.view(p, b, dt, r * m, r * m + w)
                              for p in range(n)], op)
        out[c0:c1].copy_(acc)
