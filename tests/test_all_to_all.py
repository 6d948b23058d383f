"""primitives.all_to_all{,_single} against gloo's built-in: N = 1…8, even and uneven splits
(empty blocks included), non-contiguous tensors, in place, dtypes, the list form, the ledger
against cost.traffic, bad input on every rank, and a dead peer named.

All-to-all moves data without arithmetic, so every comparison is bitwise.
"""
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import primitives as P
from primitives.engine.reference import ref as builtin
from primitives.engine.cost import traffic
from primitives.engine.ledger import LEDGER

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.bool)


def _rows(seed, rank, n):
    """Rows rank sends to each peer: deterministic, uneven, with empty blocks; any rank can recompute."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return [int(v) for v in torch.randint(0, 4, (n,), generator=g)]


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-100, 100, shape, generator=g)
    return (x > 0) if dtype == torch.bool else x.to(dtype)


def _case(n, r, algo, seed, dtype, uneven, layout, errs, traffic_rows):
    row = (3,)
    ins = _rows(seed, r, n) if uneven else [2] * n
    outs = [_rows(seed, p, n)[r] for p in range(n)] if uneven else [2] * n
    x = _data((sum(ins),) + row, dtype, seed * 1000 + r)
    if layout == "transposed":                        # same values, a non-contiguous view
        x = x.t().contiguous().t()
    y = torch.full((sum(outs),) + row, 7, dtype=torch.int64).to(dtype)
    if layout == "transposed":
        y = y.t().contiguous().t()
    ref = torch.zeros((sum(outs),) + row, dtype=dtype)
    x0 = x.clone()
    with LEDGER.track() as d:
        P.all_to_all_single(y, x, outs if uneven else None, ins if uneven else None, algorithm=algo)
    builtin("all_to_all_single", P.get_comm(), ref, x.contiguous(),
            output_split_sizes=outs if uneven else None, input_split_sizes=ins if uneven else None)
    tag = f"N={n} rank={r} algo={algo} dtype={dtype} uneven={uneven} layout={layout}"
    if not torch.equal(y, ref):
        errs.append(f"{tag}: differs from the built-in")
    if not torch.equal(x, x0):
        errs.append(f"{tag}: input modified")
    used = LEDGER.calls[-1].algorithm
    exp = traffic("all_to_all_single", used, n, r, x.numel(), x.element_size(), splits=[s * 3 for s in ins])
    if (d.msgs_sent, d.bytes_sent) != exp:
        errs.append(f"{tag}: ledger {(d.msgs_sent, d.bytes_sent)} != cost.traffic {exp}")
    traffic_rows.append((d.bytes_sent, d.bytes_recv))


def _list_case(n, r, algo, seed, errs):
    # rank r sends a tensor of shape (k, r+1) to rank p, k from the uneven table: shapes differ per pair
    ks = _rows(seed, r, n)
    ins = [_data((ks[p], r + 1), torch.float32, seed + 10 * r + p) for p in range(n)]
    ins[0] = ins[0].t()                                # a non-contiguous element
    outs = [torch.empty(_rows(seed, p, n)[r], p + 1) for p in range(n)]
    refs = [torch.empty_like(o) for o in outs]
    P.all_to_all(outs, ins, algorithm=algo)
    builtin("all_to_all", P.get_comm(), refs, [t.contiguous() for t in ins])
    for p, (o, e) in enumerate(zip(outs, refs)):
        if not torch.equal(o, e):
            errs.append(f"all_to_all list N={n} rank={r} algo={algo}: output[{p}] differs from the built-in")


def _matrix(rank, n, dtypes, layouts):
    errs, counts = [], []
    seed = 0
    for algo in ("linear", "pairwise", "auto"):
        for dtype in dtypes:
            for uneven in (False, True):
                for layout in layouts:
                    seed += 1
                    _case(n, rank, algo, seed, dtype, uneven, layout, errs, counts)
        seed += 1
        _list_case(n, rank, algo, seed, errs)
    # in place: output is input (even split), as torch allows
    x = torch.arange(4 * n, dtype=torch.float32) + 100 * rank
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x.clone())
    P.all_to_all_single(x, x)
    if not torch.equal(x, ref):
        errs.append(f"rank {rank}: in-place all_to_all_single differs from the built-in")
    return errs, counts


@pytest.mark.parametrize("n", [1, 2, 3, 4] + [pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7, 8)])
def test_all_to_all_matches_builtin(spawn, n):
    """float32 and int64 (N ≤ 4), even and uneven splits, both algorithms and auto, the list form."""
    results = spawn(_matrix, n, args=((torch.float32, torch.int64) if n <= 4 else (torch.float32,),
                                      ("contig", "transposed") if n in (3, 4) else ("contig",)))
    errs = [e for es, _ in results for e in es]
    assert not errs, "\n".join(errs[:15])
    for case in range(len(results[0][1])):          # conservation: Σ sent == Σ received, per call
        sent = sum(res[1][case][0] for res in results)
        recv = sum(res[1][case][1] for res in results)
        assert sent == recv, f"call {case}: {sent} bytes sent, {recv} received"


def test_all_to_all_dtypes(spawn):
    results = spawn(_matrix, 3, args=(DTYPES, ("contig",)))
    errs = [e for es, _ in results for e in es]
    assert not errs, "\n".join(errs[:15])


def test_traffic_formula_even_split():
    """(N-1) messages of S/N bytes per rank, for both algorithms (no processes)."""
    for n in range(1, 9):
        for algo in P.ALGORITHMS["all_to_all_single"]:
            assert traffic("all_to_all_single", algo, n, 0, 8 * n, 4) == ((n - 1, (n - 1) * 32) if n > 1 else (0, 0))
    assert traffic("all_to_all", "linear", 3, 1, 0, 2, splits=[5, 9, 0]) == (1, 10)   # own block and empty ones: free


# ----------------------------------------------------------------------------- bad input

def _bad(rank, n):
    cases = [
        ("uneven dim 0 without splits", lambda: P.all_to_all_single(torch.empty(2 * n + 1), torch.zeros(2 * n + 1)),
         ["'input_split_sizes' is None", "divisible by world_size"]),
        ("splits of wrong length", lambda: P.all_to_all_single(torch.empty(n), torch.zeros(n), [1] * n, [1] * (n + 1)),
         ["'input_split_sizes'", f"{n} non-negative ints"]),
        ("splits do not sum to dim 0", lambda: P.all_to_all_single(torch.empty(n), torch.zeros(n), [1] * n, [2] * n),
         ["'input_split_sizes'", f"sums to {2 * n}", f"dim 0 of the tensor is {n}"]),
        ("pairwise mismatch on one rank",
         lambda: P.all_to_all_single(torch.empty(n + (rank == 1)), torch.zeros(n), [1] * n if rank != 1 else [2] + [1] * (n - 1), None),
         ["rank 0 sends 1 elements to rank 1 but rank 1 expects 2"]),
        ("dtype", lambda: P.all_to_all_single(torch.empty(n, dtype=torch.float64), torch.zeros(n)),
         ["'output'", "torch.float64", "torch.float32"]),
        ("rows differ", lambda: P.all_to_all_single(torch.empty(n, 2), torch.zeros(n, 3)), ["rows of shape (2,)", "(3,)"]),
        ("not a tensor on rank 2", lambda: P.all_to_all_single(torch.empty(n), torch.zeros(n) if rank != 2 else [0.0] * n),
         ["rank 2", "'input'", "torch.Tensor"]),
        ("list too short", lambda: P.all_to_all([torch.empty(1)] * (n - 1), [torch.zeros(1)] * n),
         ["'output_tensor_list'", f"list of {n} tensors"]),
        ("list sizes mismatch on rank 0",
         lambda: P.all_to_all([torch.empty(1) for _ in range(n)], [torch.zeros(1 + (rank == 0)) for _ in range(n)]),
         ["rank 0 sends 2 elements to rank 0 but rank 0 expects 1"]),
        ("unknown algorithm", lambda: P.all_to_all_single(torch.empty(n), torch.zeros(n), algorithm="ring"),
         ["'algorithm'", "'ring'", "'pairwise'"]),
    ]
    out = []
    for label, call, words in cases:
        try:
            call()
            out.append((label, None, "no error", words))
        except Exception as e:
            out.append((label, type(e).__name__, str(e), words))
    x = torch.arange(n, dtype=torch.float32) + 10 * rank     # still usable afterwards
    y = torch.empty(n)
    P.all_to_all_single(y, x)
    return out, y.tolist()


def test_bad_input_raises_on_every_rank(spawn):
    n = 3
    results = spawn(_bad, n, comm_timeout=20)
    problems = []
    for rank, (rows, after) in enumerate(results):
        assert after == [float(10 * p + rank) for p in range(n)], f"rank {rank}: broken after errors"
        for label, etype, msg, words in rows:
            missing = [w for w in [f"rank {rank}"] + words if w not in msg]
            if etype != "CollectiveError" or missing:
                problems.append(f"[{label}] rank {rank}: {etype}: {msg[:300]} (missing {missing})")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- dead peer

def _dies(rank, n, algo):
    if rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        P.all_to_all_single(torch.empty(3 * n), torch.zeros(3 * n), algorithm=algo)
        return ("returned", 0.0, "")
    except Exception as e:
        return (type(e).__name__, time.monotonic() - t0, str(e))


@pytest.mark.parametrize("algo", ["linear", pytest.param("pairwise", marks=pytest.mark.slow)])
def test_dead_peer_is_named(algo):
    from primitives.launch import spawn
    comm_timeout = 4.0
    res = spawn(_dies, 3, args=(algo,), comm_timeout=comm_timeout, grace=comm_timeout + 10, allow_fail=True, timeout=60)
    assert res[1] == ("exit", 3), res
    for r in (0, 2):
        status, (etype, secs, msg) = res[r]
        assert status == "ok" and etype == "PeerError", res[r]
        assert secs < comm_timeout + 10, msg
        assert re.search(r"Root cause: rank 1 died|did rank 1 die", msg), msg     # every survivor names the dead rank


def _strict(rank, n):
    P.set_strict_p2p(True)     # nccl's ordering rules over gloo: an ungrouped exchange is a reported deadlock
    assert P.get_comm().strict
    errs = []
    for algo in ("auto", "linear", "pairwise"):
        for uneven in (False, True):
            _case(n, rank, algo, 5, torch.float32, uneven, "contig", errs, [])
    return errs


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_under_strict_mode(spawn, n):
    """The counts exchange and every algorithm post their messages as one group (nccl-safe):
    under strict mode they finish, equal to the built-in, for even and uneven splits."""
    errs = [e for r in spawn(_strict, n, comm_timeout=30) for e in r]
    assert not errs, "\n".join(errs[:10])
