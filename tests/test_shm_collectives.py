"""algorithm="shm" (primitives/engine/shm_collectives.py) bit for bit, and its check.

    python -m pytest -q tests/test_shm_collectives.py

Reference order: every element of an all-reduce / reduce-scatter is reduced in rank order,
((x0 op x1) op x2) op ..., each step rounded to the dtype (AVG: that sum, then one division by
N). The test computes exactly that in one process from every rank's regenerated input and
asks for identical bits, for every op and dtype, at sizes on both sides of the one-shot
threshold and of the round boundaries (rounds made small so that they are cheap to cross),
with N = 2, 3, 4 (3: uneven slots); a few floats three times (the replayed plan reduces them item
by item: primitives/engine/planned.py). Against torch's gloo (a different order): integers
bitwise, floats within N·eps·Σ|x| (the bound of tests/collective_checks.py).
"""
import pytest
import torch
import torch.distributed as dist

import primitives as P
from primitives.ops import combine_

OPS = {"sum": P.ReduceOp.SUM, "avg": P.ReduceOp.AVG, "product": P.ReduceOp.PRODUCT,
       "min": P.ReduceOp.MIN, "max": P.ReduceOp.MAX}
WS, ONE_SHOT = 48 << 10, 16 << 10          # bytes: rounds of 12,288 float32, one-shot up to 4,096


def _x(p: int, k: int, dtype, op: str, salt: int) -> torch.Tensor:
    """Rank p's input, the same on every rank that regenerates it."""
    g = torch.Generator().manual_seed(7919 * p + 104_729 * k + salt)
    if dtype.is_floating_point:
        x = (1 + 0.05 * torch.randn(k, generator=g, dtype=torch.float64)) if op == "product" \
            else 4 * torch.randn(k, generator=g, dtype=torch.float64)
    else:
        x = torch.randint(-2, 3, (k,), generator=g) if op == "product" else torch.randint(-1000, 1000, (k,), generator=g)
    return x.to(dtype)


def _rank_order(xs, op):
    acc = xs[0].clone()
    for x in xs[1:]:
        combine_(acc, x, op)
    return acc / len(xs) if op == "avg" else acc


def _close_to_gloo(mine, xs, op, n):
    """gloo's built-in on the same input: integers equal, floats within N·eps·Σ|x| (values
    near 1 for PRODUCT: Σ|x| bounds Π|x| there)."""
    x = xs[dist.get_rank()]
    g = x.clone()
    dist.all_reduce(g, op=OPS["sum" if op == "avg" else op])
    if op == "avg":
        g = g / n
    if not x.dtype.is_floating_point:
        return torch.equal(mine, g)
    bound = n * torch.finfo(x.dtype).eps * sum(y.abs().double() for y in xs)
    return bool(((mine.double() - g.double()).abs() <= bound).all())


def _parity(rank, n, dtypes, sizes):
    from primitives.engine import shm_collectives as sc
    comm = P.get_comm()
    sc.state(comm).W, sc.ONE_SHOT_BYTES, sc.ONE_SHOT_BYTES_2 = WS, ONE_SHOT, ONE_SHOT   # both ways at N = 2 too
    assert comm.transport == "shm", comm.transport
    errs = []
    for di, dtype in enumerate(dtypes):
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for k in sizes:
                salt = 31 * di + len(op)
                xs = [_x(p, k, dtype, op, salt) for p in range(n)]
                ref = _rank_order(xs, op)
                for i in range(3 if k <= 8 else 1):           # a few floats: the third call replays item by item
                    t = xs[rank].clone()
                    P.all_reduce(t, op=OPS[op], algorithm="shm")
                    if not torch.equal(t, ref):
                        bad = (t != ref).nonzero()[:3].flatten().tolist()
                        errs.append(f"rank {rank}: all_reduce {dtype} {op} k={k} call {i}: not rank-order bits at {bad}")
                if op != "avg" and not _close_to_gloo(t, xs, op, n):
                    errs.append(f"rank {rank}: all_reduce {dtype} {op} k={k}: outside the bound of gloo's result")
                kb = max(1, k // n)                             # reduce_scatter: blocks of kb, N of them
                blocks = [x[:n * kb] for x in xs] if k >= n else [_x(p, n, dtype, op, salt) for p in range(n)]
                out = torch.empty(kb, dtype=dtype)
                P.reduce_scatter_single(out, blocks[rank].clone(), op=OPS[op], algorithm="shm")
                want = _rank_order(blocks, op)[rank * kb:(rank + 1) * kb]
                if not torch.equal(out, want):
                    errs.append(f"rank {rank}: reduce_scatter_single {dtype} {op} k={kb}: not rank-order bits")
            if op == "sum":
                for k in sizes:
                    ys = [_x(p, k, dtype, op, 5) for p in range(n)]
                    got = torch.empty(n * k, dtype=dtype)
                    P.all_gather_single(got, ys[rank], algorithm="shm")
                    lst = [torch.empty(k, dtype=dtype) for _ in range(n)]
                    P.all_gather(lst, ys[rank], algorithm="shm")
                    if not (torch.equal(got, torch.cat(ys)) and all(torch.equal(a, b) for a, b in zip(lst, ys))):
                        errs.append(f"rank {rank}: all_gather {dtype} k={k}: wrong blocks")
    return errs


R = WS // 4                                  # float32 elements per round
SIZES = [1, 7, ONE_SHOT // 4 - 1, ONE_SHOT // 4, ONE_SHOT // 4 + 1, R - 1, R, R + 1, 3 * R + 5]


@pytest.mark.slow                     # ~10-40 s each; tests/test_shm.py runs algorithm="shm" in the default suite
@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_collectives_bitwise_rank_order(spawn, n):
    dtypes = [torch.float32, torch.bfloat16, torch.int32] + ([torch.float64, torch.int64] if n == 4 else [])
    for errs in spawn(_parity, n, args=(dtypes, SIZES), transport="shm"):
        assert errs == [], errs[:5]


def _mismatches(rank, n):
    comm = P.get_comm()
    out = []

    def attempt(fn):
        try:
            fn()
            out.append("no error")
        except P.CollectiveError as e:
            out.append(str(e))
    heads = dict(comm._head)
    t = torch.full((300_000,), float(rank + 1))
    P.all_reduce(t, algorithm="shm")                 # checked (the default): no message of its own
    out.append(dict(comm._head) == heads and bool((t == sum(range(1, n + 1))).all()))
    attempt(lambda: P.all_reduce(torch.ones(10 + rank), algorithm="shm"))
    attempt(lambda: P.all_reduce(torch.ones(8), algorithm="shm") if rank == 0
            else P.all_gather_single(torch.empty(8 * n), torch.ones(8), algorithm="shm"))
    attempt(lambda: P.all_reduce(torch.ones(8) if rank else [1.0] * 8, algorithm="shm"))
    attempt(lambda: P.all_reduce(torch.ones(8), algorithm="shm") if rank == 0
            else P.broadcast(torch.ones(8), src=0))
    t = torch.full((300_000,), float(rank + 1))      # afterwards a matched call works, large and small
    P.all_reduce(t, algorithm="shm")
    s = torch.full((5,), float(rank))
    P.all_reduce(s, algorithm="shm")
    out.append(bool((t == sum(range(1, n + 1))).all()) and bool((s == sum(range(n))).all()))
    return out


def test_shm_check_rides_in_the_header_and_a_mismatch_raises_on_every_rank(spawn):
    """Sizes differ, collectives differ, one rank's bad argument, and a peer in a message-based
    call (broadcast): CollectiveError on every rank, naming what differs; a checked shm call
    sends no message; the communicator stays usable."""
    res = spawn(_mismatches, 3, transport="shm")
    for r, out in enumerate(res):
        clean, sizes, calls, args, other, after = out
        assert clean is True, f"rank {r}: a checked shm all-reduce sent messages or summed wrongly"
        assert "disagree" in sizes and f"numel={10 + r}" in sizes, sizes
        assert "disagree" in calls and "all_gather_single" in calls and "all_reduce" in calls, calls
        assert "invalid arguments" in args or (r == 0 and "must be a torch.Tensor" in args), args
        assert "disagree" in other and "broadcast" in other, other
        assert after is True, f"rank {r}: the next calls went wrong after the mismatches"
