"""primitives' torch.distributed signatures, against torch.distributed itself on the same ranks
(gloo, N = 3): group_src/group_dst, the Work an async call returns (wait(timeout), get_future,
exception, is_success), None outside the group, BAND/BOR/BXOR, complex tensors, uneven
reduce_scatter lists, torch's keyword names, the sparse-tensor error, *_coalesced and *_object.

    python -m pytest -q tests/test_primitives_torch_api.py        (~15 s)

Integer, bitwise and data-moving results must be bitwise equal to torch's; float sums are
compared with the N·eps·Σ|x| bound of tests/collective_checks.py (here: small integers in
float, so they are exact too).
"""
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import primitives as P


def _same(errs, what, ours, theirs):
    if isinstance(ours, torch.Tensor):
        ok = ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    else:
        ok = ours == theirs
    if not ok:
        errs.append(f"{what}: ours {ours} vs torch {theirs}")


def _api(rank, n):
    errs = []
    R = dist.ReduceOp
    # bitwise ops on integer and bool tensors
    for op in (R.BAND, R.BOR, R.BXOR):
        for dtype in (torch.int64, torch.uint8, torch.bool):
            x = (torch.arange(6) * (rank + 3) % 7).to(dtype) if dtype != torch.bool else torch.arange(6) % (rank + 2) == 0
            a, b = x.clone(), x.clone()
            P.all_reduce(a, op)
            dist.all_reduce(b, op)
            _same(errs, f"all_reduce {op} {dtype}", a, b)
    a = torch.arange(4 * n, dtype=torch.int32) * (rank + 1)
    out_a, out_b = torch.empty(4, dtype=torch.int32), torch.empty(4, dtype=torch.int32)
    P.reduce_scatter_single(out_a, a.clone(), R.BXOR)
    dist.reduce_scatter_tensor(out_b, a.clone(), R.BXOR)
    _same(errs, "reduce_scatter_single BXOR", out_a, out_b)
    with pytest.raises(P.CollectiveError, match=f"rank {rank}: all_reduce.*bitwise op"):
        P.all_reduce(torch.ones(3), R.BAND)
    # complex: data movement everywhere, SUM/AVG reduce, the rest refused as torch does
    c = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64) * (rank + 1)
    a, b = c.clone(), c.clone()
    P.all_reduce(a)
    dist.all_reduce(b)
    _same(errs, "complex all_reduce SUM", a, b)
    g = [torch.empty_like(c) for _ in range(n)]
    P.all_gather(g, c)
    _same(errs, "complex all_gather", torch.stack(g), torch.stack([c / (rank + 1) * (p + 1) for p in range(n)]))
    with pytest.raises(ValueError, match=f"rank {rank}: all_reduce does not support"):
        P.all_reduce(c.clone(), R.MAX)
    # group_src / group_dst on a sub-group whose group ranks differ from the global ones
    sub = dist.new_group([1, 2])                          # group ranks 0, 1 are global ranks 1, 2
    if rank in (1, 2):
        t = torch.full((3,), float(rank))
        P.broadcast(t, group=sub, group_src=0)
        _same(errs, "broadcast group_src=0", t, torch.full((3,), 1.0))
        t = torch.full((2,), float(rank + 1))
        P.reduce(t, group=sub, group_dst=1)
        if rank == 2:
            _same(errs, "reduce group_dst=1", t, torch.full((2,), 5.0))
        got = [torch.empty(1) for _ in range(2)] if rank == 2 else None
        P.gather(torch.tensor([float(rank)]), got, group=sub, group_dst=1)
        if rank == 2:
            _same(errs, "gather group_dst=1", torch.cat(got), torch.tensor([1.0, 2.0]))
        t = torch.empty(1)
        P.scatter(t, [torch.tensor([5.0]), torch.tensor([6.0])] if rank == 1 else None, group=sub, group_src=0)
        _same(errs, "scatter group_src=0", t, torch.tensor([5.0 if rank == 1 else 6.0]))
        with pytest.raises(P.CollectiveError, match="both given"):
            P.broadcast(torch.ones(1), src=1, group=sub, group_src=0)
    else:                                                 # outside the group: a warning and None, as torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r = P.broadcast(torch.ones(1), group=sub, group_src=0)
        _same(errs, "outside the group returns None", r, None)
        _same(errs, "outside the group warns", any("does not belong" in str(x.message) for x in w), True)
    # uneven reduce_scatter list: block p is rank p's output size (gloo's rule)
    blocks = [torch.arange(p + 1, dtype=torch.float32) * (rank + 1) for p in range(n)]
    a, b = torch.empty(rank + 1), torch.empty(rank + 1)
    P.reduce_scatter(a, [x.clone() for x in blocks])
    dist.reduce_scatter(b, [x.clone() for x in blocks])
    _same(errs, "uneven reduce_scatter", a, b)
    # torch's keyword names
    o = torch.empty(2 * n)
    P.all_gather_single(output_tensor=o, input_tensor=torch.full((2,), float(rank)))
    _same(errs, "all_gather_single(output_tensor=, input_tensor=)", o, torch.arange(n).float().repeat_interleave(2))
    with pytest.raises(P.CollectiveError, match=f"rank {rank}: all_reduce: argument 'tensor' is a torch.sparse_coo"):
        P.all_reduce(torch.ones(3).to_sparse())
    # coalesced and object collectives against torch's
    ts = [torch.full((2,), float(rank)), torch.full((3,), 2.0 * rank)]
    ref = [t.clone() for t in ts]
    fut = P.all_reduce_coalesced(ts, async_op=True)
    fut.wait()
    dist.all_reduce_coalesced(ref)
    _same(errs, "all_reduce_coalesced", torch.cat(ts), torch.cat(ref))
    ins = [torch.full((2,), float(rank)), torch.full((1,), 10.0 * rank)]
    outs = [[torch.empty(2), torch.empty(1)] for _ in range(n)]
    refs = [[torch.empty(2), torch.empty(1)] for _ in range(n)]
    P.all_gather_coalesced(outs, ins)
    dist.all_gather_coalesced(refs, ins)
    _same(errs, "all_gather_coalesced", torch.cat([torch.cat(o) for o in outs]), torch.cat([torch.cat(o) for o in refs]))
    obj = {"rank": rank, "pad": "x" * (7 * rank)}       # pickles of different sizes
    o1, o2 = [None] * n, [None] * n
    P.all_gather_object(o1, obj)
    dist.all_gather_object(o2, obj)
    _same(errs, "all_gather_object", o1, o2)
    l1 = [obj, 3] if rank == 1 else [None, None]
    l2 = list(l1)
    P.broadcast_object_list(l1, src=1)
    dist.broadcast_object_list(l2, src=1)
    _same(errs, "broadcast_object_list", l1, l2)
    g1, g2 = ([None] * n, [None] * n) if rank == 2 else (None, None)
    P.gather_object(obj, g1, dst=2)
    dist.gather_object(obj, g2, dst=2)
    _same(errs, "gather_object", g1, g2)
    s1, s2 = [None], [None]
    src_list = [f"to {p}" * (p + 1) for p in range(n)] if rank == 0 else None
    P.scatter_object_list(s1, src_list, src=0)
    dist.scatter_object_list(s2, src_list, src=0)
    _same(errs, "scatter_object_list", s1, s2)
    return errs


def _work(rank, n):
    """Work semantics: wait(timeout) raises while a peer has not joined; get_future, exception."""
    errs = []
    x = torch.full((4,), float(rank))
    if rank == 0:
        w = P.all_reduce(x, async_op=True)
        try:
            w.wait(timeout=timedelta(milliseconds=200))   # the others sit in the barrier below: cannot finish
            errs.append("wait(timeout) returned although the peers had not joined")
        except RuntimeError as e:
            _same(errs, "timeout names rank and call", "rank 0: all_reduce: Work.wait(timeout=0.2s)" in str(e), True)
        _same(errs, "not completed yet", (w.is_completed(), w.exception()), (False, None))
        dist.barrier()
        _same(errs, "future holds the output", w.get_future().wait()[0].tolist(), [float(sum(range(n)))] * 4)
        _same(errs, "completed", (w.is_completed(), w.is_success(), w.exception(), w.wait()), (True, True, None, True))
    else:
        dist.barrier()
        P.all_reduce(x)
    w = P.all_reduce(torch.ones(2), op="bogus", async_op=True)   # bad on every rank: raised by every rank
    with pytest.raises(P.CollectiveError, match=f"rank {rank}: all_reduce: argument 'op'"):
        w.wait()
    _same(errs, "exception() after a failed call", type(w.exception()).__name__, "CollectiveError")
    _same(errs, "is_success() after a failed call", w.is_success(), False)
    fut = P.all_gather_single(torch.empty(n), torch.tensor([float(rank)]), async_op=True).get_future()
    _same(errs, "get_future on all_gather_single", fut.wait()[0].tolist(), [float(p) for p in range(n)])
    return errs


def test_torch_signatures_against_torch_distributed(spawn):
    errs = [e for r in spawn(_api, 3) for e in r]
    assert not errs, "\n".join(errs)


def test_work_wait_timeout_future_and_exception(spawn):
    errs = [e for r in spawn(_work, 2) for e in r]
    assert not errs, "\n".join(errs)
