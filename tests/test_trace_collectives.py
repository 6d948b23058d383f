"""The collectives a user calls with defaults run the functions READING.md names: traced.

    python -m pytest -q tests/test_trace_collectives.py

Each case is one public call with nothing but its tensor: `primitives.all_reduce(t)` at 4 KiB
and at a size past one shot (1 MiB; 4 MiB on 2 ranks, where one shot runs up to a 2 MiB workspace),
`primitives.all_gather_single(out, t)` and `primitives.reduce_scatter_single(out, t)`,
on 2 and on 4 ranks of one host (the default transport: shared memory). On every rank
sys.setprofile / threading.setprofile record (file, qualified name) of every Python call while the
call runs (the third call of each signature, so a replayed plan is what is traced: for all_reduce
its Planned, primitives/engine/planned.py); the test
asserts that exactly the READING.md functions of that case ran, and that the result equals the
sum computed here. Cost: two spawns, a few seconds each.
"""
import os
import sys
import threading

import pytest
import torch

from benchmarks import textbook as T

# case -> (the READING.md ideas that must run in it, those that must not)
CASES = {
    "all_reduce 4 KiB": (["shared-memory one-shot all-reduce"], ["shared-memory reduce-by-slices all-reduce"]),
    "all_reduce by slices": (["shared-memory reduce-by-slices all-reduce", "chunk rule"],
                         ["shared-memory one-shot all-reduce"]),
    "all_gather_single": (["shared-memory all-gather"], []),
    "reduce_scatter_single": (["shared-memory reduce-scatter"], []),
}


def _calls(case, rank, n):
    """(a function making the call, a function checking its result)."""
    import primitives
    if case.startswith("all_reduce"):
        k = 1024 if "4 KiB" in case else 1 << 18 if n > 2 else 1 << 20
        t = torch.full((k,), float(rank + 1))
        return (lambda: primitives.all_reduce(t)), (lambda: torch.equal(t, torch.full((k,), n * (n + 1) / 2)))
    if case == "all_gather_single":
        x, out = torch.full((300,), float(rank)), torch.empty(300 * n)
        ref = torch.arange(n, dtype=torch.float32).repeat_interleave(300)
        return (lambda: primitives.all_gather_single(out, x)), (lambda: torch.equal(out, ref))
    x, out = torch.arange(300 * n, dtype=torch.float32) + rank, torch.empty(300)
    ref = n * torch.arange(300 * rank, 300 * (rank + 1), dtype=torch.float32) + n * (n - 1) / 2
    return (lambda: primitives.reduce_scatter_single(out, x)), (lambda: torch.equal(out, ref))


def _traced(rank, n, root):
    out = {}
    for case in CASES:
        call, ok = _calls(case, rank, n)
        call()                                          # the first call builds the plan,
        call()                                          # the second counts its ledger record
        seen = set()

        def hook(frame, event, arg):
            if event == "call":
                seen.add((frame.f_code.co_filename, frame.f_code.co_qualname))
        threading.setprofile(hook)
        sys.setprofile(hook)
        try:
            call()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        call, ok = _calls(case, rank, n)
        call()
        out[case] = (ok(), sorted({(os.path.relpath(f, root), q) for f, q in seen if f.startswith(root + os.sep)}))
    return out


def _ran(entry, calls) -> bool:
    return any(f == entry.path and q == entry.name for f, q in calls)


@pytest.mark.parametrize("n", [2, 4])
def test_default_collectives_run_the_reading_functions(n):
    from primitives.launch import spawn
    entries = {e.idea: e for e in T.reading_entries()}
    res = spawn(_traced, n, args=(T.ROOT,), timeout=180.0)
    bad = []
    for case, (must, must_not) in CASES.items():
        for r, out in enumerate(res):
            ok, calls = out[case]
            if not ok:
                bad.append(f"{case}: rank {r}: wrong result")
            for idea in must:
                if not _ran(entries[idea], calls):
                    bad.append(f"{case}: rank {r}: {idea} ({entries[idea].path}::{entries[idea].name}) did not run; "
                               f"ran: {sorted({q for f, q in calls if f.startswith('primitives/') and 'engine' not in f})}")
            for idea in must_not:
                if _ran(entries[idea], calls):
                    bad.append(f"{case}: rank {r}: {idea} ran, but this size takes the other algorithm")
    assert not bad, "\n".join(bad)


def _replayed_then_mismatched(rank, n):
    import primitives
    from primitives.engine import planned as calls
    comm = primitives.get_comm()
    t = torch.ones(1000)
    primitives.all_reduce(t)
    plans = len(comm.plans)
    primitives.all_reduce(t)                              # replayed: no new plan
    replayed = len(comm.plans) == plans
    calls_made = {"n": 0}
    orig = calls.plan

    def counting(*a, **k):
        calls_made["n"] += 1
        return orig(*a, **k)
    calls.plan = counting
    try:
        primitives.all_reduce(t)
        primitives.all_reduce(torch.ones(7))             # a new signature: planned
    finally:
        calls.plan = orig
    try:                                                  # rank 0 replays, rank 1 passes another size
        primitives.all_reduce(torch.ones(1000 if rank == 0 else 999))
        err = ""
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    u = torch.full((5,), float(rank))
    primitives.all_reduce(u)                              # the communicator still works
    return replayed, calls_made["n"], err, u.tolist()


def test_a_replayed_call_is_still_checked_across_ranks():
    """The second call of a signature adds no plan and builds none (a new signature builds one); a
    rank replaying its plan while its peer passes another size still raises, on both ranks."""
    from primitives.launch import spawn
    res = spawn(_replayed_then_mismatched, 2, timeout=120.0)
    for r, (replayed, built, err, u) in enumerate(res):
        assert replayed and built == 1, (r, replayed, built)
        assert err.startswith("CollectiveError") and "numel=1000" in err and "numel=999" in err, (r, err)
        assert u == [1.0] * 5, (r, u)


def _replayed_ledger(rank, n):
    import primitives
    from primitives.engine.ledger import LEDGER
    from primitives.engine.traffic import traffic
    out = {}
    for name, algo, make in (("all_reduce", "ring", lambda: (torch.ones(1000),)),
                             ("broadcast", "tree", lambda: (torch.ones(300), 0)),
                             ("reduce_scatter_single", "ring", lambda: (torch.zeros(100), torch.ones(100 * n))),
                             ("all_reduce", "auto", lambda: (torch.ones(1000),))):
        rows = []
        for _ in range(4):                   # planned, first replay (counted), two replays (the record added)
            args = make()
            with LEDGER.track() as d:
                getattr(primitives, name)(*args, algorithm=algo)
            rec = LEDGER.calls[-1]
            rows.append(((d.msgs_sent, d.bytes_sent, d.msgs_recv, d.bytes_recv),
                         (rec.counts.msgs_sent, rec.counts.bytes_sent), rec.template is not None))
        numel = 100 if name == "reduce_scatter_single" else args[0].numel()
        out[f"{name} {algo}"] = (rows, traffic(name, LEDGER.calls[-1].algorithm, n, rank, numel, 4))
    with LEDGER.control_traffic(), LEDGER.track() as d:  # a replay the caller marks as control adds no data
        primitives.all_reduce(torch.ones(1000), algorithm="ring")
    return out, d.msgs_sent + d.msgs_recv


def test_a_replayed_call_adds_the_ledger_record_it_would_count():
    """A replayed call counts no message: its record is its signature's first replay's, added at
    its end. Every call of a signature gives the same totals and record, equal to the closed form
    (traffic.py), and the last two really took the record (not the per-message counts); a
    replay the caller marks as control traffic adds no data."""
    from primitives.launch import spawn
    for r, (out, control) in enumerate(spawn(_replayed_ledger, 2, timeout=120.0)):
        assert control == 0, (r, control)
        for case, (rows, formula) in out.items():
            assert len({row[:2] for row in rows}) == 1, (r, case, rows)
            assert rows[0][1] == formula, (r, case, rows[0], formula)
            assert [row[2] for row in rows] == [False, False, True, True], (r, case, rows)


def _planned(rank, n):
    import primitives
    from primitives.engine import core
    from primitives.engine.ledger import LEDGER
    comm, out = primitives.get_comm(), {}

    def traced(fn):
        seen = set()

        def hook(frame, event, arg):
            if event == "call":
                seen.add(frame.f_code.co_qualname)
        sys.setprofile(hook)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return seen
    for op in (primitives.ReduceOp.SUM, primitives.ReduceOp.AVG):
        for _ in range(3):                               # plan, record, planned from then on
            t = torch.arange(6.0).reshape(2, 3) + rank
            primitives.all_reduce(t, op)
        t = torch.arange(6.0).reshape(2, 3) + rank
        with LEDGER.track() as d:
            seen = traced(lambda: primitives.all_reduce(t, op))
        out[str(op)] = (t.tolist(), "Planned.run" in seen and "shm_one_shot" in seen and "run" not in seen,
                        LEDGER.calls[-1].template is not None, (d.msgs_sent, d.bytes_sent))
    t = (torch.arange(6.0).reshape(3, 2) + rank).t()       # same dtype and shape, not contiguous: full path
    seen = traced(lambda: primitives.all_reduce(t))
    out["strided"] = (t.tolist(), "run" in seen and "shm_one_shot" in seen)
    core.set_handshake(False)                              # the unchecked setting has its own Planned
    out["switched"] = len(comm.planned)
    core.set_handshake(True)
    for _ in range(3):
        primitives.all_reduce(torch.ones(5))
    try:                                                   # rank 0 replays its Planned, rank 1 another tag
        primitives.all_reduce(torch.ones(5), tag=0 if rank == 0 else 3)
        out["mismatch"] = ""
    except Exception as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    u = torch.ones(5)
    primitives.all_reduce(u)
    out["after"] = u.tolist()
    g = torch.distributed.new_group(list(range(n)))       # a group passed explicitly is planned too
    for _ in range(3):
        primitives.all_reduce(torch.ones(4), group=g)
    v = torch.ones(4)
    seen = traced(lambda: primitives.all_reduce(v, group=g))
    out["group"] = (v.tolist(), "Planned.run" in seen and "run" not in seen)
    w = torch.ones(4)                                     # the communicator's method as well
    for _ in range(3):
        comm.all_reduce(w, "sum")
    seen = traced(lambda: comm.all_reduce(w, "sum"))
    out["method"] = (w.tolist(), "Planned.run" in seen and "run" not in seen)
    from primitives.engine import planned
    out["items"] = _items(rank, traced)
    planned.ENABLED = False                               # RINGZERO_PLANNED=0: every call takes the full path
    planned.forget()
    for _ in range(4):
        primitives.all_reduce(torch.ones(4))
    out["disabled"] = len(comm.planned)
    planned.ENABLED = True
    return out


def _items(rank, traced):
    """A few floats replayed item by item (planned.ITEMS) and through torch ops (ITEMS = 0): the bits of
    each, whether the torch ops' reduction ran, and whether autograd saw the in-place write."""
    import primitives
    from primitives.engine import planned
    g = torch.Generator().manual_seed(rank)
    special = [0.0, -0.0, float("inf"), 1e-45, 3.4e38, 0.1, float("nan")]
    got = {}
    for dtype in (torch.float32, torch.float64):
        for op in (primitives.ReduceOp.SUM, primitives.ReduceOp.AVG, primitives.ReduceOp.PRODUCT):
            x = torch.randn(8, generator=g, dtype=torch.float64).mul(torch.randint(-300, 300, (8,), generator=g)
                                                                     .double().exp2()).to(dtype)
            x[rank % 8] = special[(rank + len(got)) % len(special)]
            for way, planned.ITEMS in (("items", 8), ("torch ops", 0)):
                planned.forget()
                for _ in range(3):                                   # plan, record, planned from then on
                    primitives.all_reduce(x.clone(), op)
                t = x.clone()
                seen = traced(lambda: primitives.all_reduce(t, op))
                got.setdefault(f"{dtype} {op}", []).append((t.view(torch.uint8).tolist(), "reduce_in_order" in seen))
    planned.ITEMS = 8
    w, x = torch.ones(3, requires_grad=True), torch.ones(3)
    y = (w * x).sum()                                                # saves x for the backward
    primitives.all_reduce(x)                                         # a replay of torch.ones(3)'s plan
    try:
        y.backward()
        got["autograd"] = ""
    except RuntimeError as e:
        got["autograd"] = str(e)
    return got


def test_a_planned_call_runs_the_textbook_function_and_keeps_the_check():
    """From a signature's third call, primitives.all_reduce(t) goes to its Planned (planned.py):
    the textbook's shm_one_shot runs without core.run, SUM and AVG give the exact sums, the
    ledger adds the same bytes as the formula (one-shot: (N-1)·S sent); a non-contiguous tensor
    of the same signature takes the full path; set_handshake drops the plans; a peer passing
    another tag still raises on both ranks; a group passed explicitly, and the communicator's
    own all_reduce method, replay their Planned as well. A few floats (float32, float64; sum, avg,
    product; random magnitudes, zeros of both signs, inf, nan, a denormal) replayed item by item give
    the bits of the torch ops' replay, and autograd sees the write as an in-place one."""
    from primitives.launch import spawn
    n = 2
    base = [[sum(3 * i + j + r for r in range(n)) for j in range(3)] for i in range(2)]
    for r, out in enumerate(spawn(_planned, n, timeout=120.0)):
        assert out[str(torch.distributed.ReduceOp.SUM)] == (base, True, True, ((n - 1), (n - 1) * 24)), (r, out)
        assert out[str(torch.distributed.ReduceOp.AVG)][0] == [[v / n for v in row] for row in base], (r, out)
        assert out[str(torch.distributed.ReduceOp.AVG)][1:3] == (True, True), (r, out)
        ref = (torch.arange(6.0).reshape(3, 2) * n + n * (n - 1) / 2).t().tolist()
        assert out["strided"] == (ref, True), (r, out)
        assert out["switched"] == 0, (r, out)
        assert out["mismatch"].startswith("CollectiveError") and "tag" in out["mismatch"], (r, out)
        assert out["after"] == [float(n)] * 5, (r, out)
        assert out["group"] == ([float(n)] * 4, True), (r, out)
        assert out["method"] == ([float(n ** 4)] * 4, True), (r, out)
        assert out["disabled"] == 0, (r, out)
        items = out.pop("items")
        assert "modified by an inplace operation" in items.pop("autograd"), (r, items)
        for case, [(bits, torch_ran), (ref, ref_ran)] in items.items():
            assert bits == ref and not torch_ran and ref_ran, (r, case, bits, ref, torch_ran, ref_ran)
