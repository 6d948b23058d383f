"""Every collective × every algorithm (+ "auto") against gloo's built-in, and the ledger
against each algorithm's traffic formula, at world sizes 1-8.

One spawn per world size runs a whole matrix of calls (tests/collective_checks.py); each rank
returns its errors, its traffic per call and a digest of every all-reduce result, and the
checks that need every rank (identical all-reduce results, conservation of bytes, per-algorithm
identities) run here in the test process.
"""
import pytest
import torch

import primitives as P
from primitives.engine.ledger import LEDGER

import collective_checks as C


def _errors(results):
    return [e for errs, _ in results for e in errs]


def _assert_clean(results):
    errs = _errors(results)
    assert not errs, f"{len(errs)} mismatches, first ones:\n" + "\n".join(errs[:15])


def _assert_allreduce_identical(results):
    """All ranks of an all-reduce must hold bitwise-identical results (not just close ones)."""
    cases = results[0][1]
    for key, info in cases.items():
        if key[0] == "all_reduce":
            digests = {rank: res[1][key]["digest"] for rank, res in enumerate(results)}
            assert len(set(digests.values())) == 1, f"{key}: ranks disagree bitwise: {digests}"


def _assert_identities(results, n, dtype=torch.int64):
    elem = torch.empty(0, dtype=dtype).element_size()
    errs = []
    for key, info in results[0][1].items():
        name, _, numel, _, _, root = key
        algos = {res[1][key]["algorithm"] for res in results}
        assert len(algos) == 1, f"{key}: ranks ran different algorithms {algos}"
        counts = [res[1][key]["counts"] for res in results]
        errs += C.traffic_identities(name, algos.pop(), n, numel, elem, root, counts)
    assert not errs, "\n".join(errs[:10])


# ----------------------------------------------------------------------------- workers

def _matrix_work(rank, n, numels, dtype, ops, layouts, names):
    return C.matrix(P.get_comm(), numels, dtype=dtype, ops=ops, layouts=layouts, names=names)


# 5 and 7 fold R = 1 and 3 ranks into P = 4, as 3 and 6 fold 1 and 2 into 2 and 4: in the slow sweep
@pytest.mark.parametrize("n", [1, 2, 3, 4, pytest.param(5, marks=pytest.mark.slow), 6,
                               pytest.param(7, marks=pytest.mark.slow), 8])
def test_every_collective_and_algorithm_int64(spawn, n):
    """Bitwise vs gloo for numel 0, 1, a count not divisible by N, and ~10k; ledger == formulas."""
    numels = [0, 1, 2 * n + 1, 10007]
    results = spawn(_matrix_work, n, args=(numels, torch.int64, ("sum",), ("contig",), None))
    _assert_clean(results)
    _assert_allreduce_identical(results)
    _assert_identities(results, n)


@pytest.mark.parametrize("n", [3, 4])
def test_non_contiguous_inputs_outputs_and_list_elements(spawn, n):
    """Strided and transposed views for inputs, outputs and list elements; gaps stay untouched."""
    results = spawn(_matrix_work, n, args=([15, 105], torch.int64, ("sum", "max"),
                                           ("strided", "transposed"), None))
    _assert_clean(results)
    _assert_allreduce_identical(results)


def _dtype_work(rank, n):
    comm = P.get_comm()
    errs, digests = [], {}
    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)):
        ops = ("sum", "product", "min", "max") + (("avg",) if dtype.is_floating_point else ())
        e, cases = C.matrix(comm, [37], dtype=dtype, ops=ops, seed=1000 * i)
        errs += e
        digests.update({(str(dtype),) + k: v for k, v in cases.items()})
    return errs, digests


@pytest.mark.parametrize("n", [3, pytest.param(4, marks=pytest.mark.slow)])   # a power of two's paths: the int64 sweep
def test_dtypes_and_ops(spawn, n):
    """float16/bfloat16/float32/float64/int32/int64 × SUM/PRODUCT/MIN/MAX/AVG(floats):
    bitwise for ints and MIN/MAX, floating SUM/AVG/PRODUCT within the summation-order bound
    derived in tests/collective_checks.py."""
    results = spawn(_dtype_work, n)
    _assert_clean(results)
    for key, info in results[0][1].items():
        if key[1] == "all_reduce":
            assert len({res[1][key]["digest"] for res in results}) == 1, f"{key}: ranks differ bitwise"


def test_large_buffer_pipelined_segments(spawn):
    """> 1 MiB so the chain algorithms (ring broadcast / reduce) send several segments."""
    def_numel = (3 << 20) // 8 + 5                      # 3 MiB of int64 + a ragged tail: k = 4
    results = spawn(_matrix_work, 3, args=([def_numel], torch.int64, ("sum",), ("contig",),
                                           ["broadcast", "reduce", "all_reduce"]))
    _assert_clean(results)
    _assert_identities(results, 3)
    key = next(k for k in results[0][1] if k[:2] == ("broadcast", "ring"))
    msgs = sorted(res[1][key]["counts"][0] for res in results)
    assert msgs == [0, 4, 4], f"ring broadcast of 3 MiB + 40 B goes in 4 segments per hop: {msgs}"


# ----------------------------------------------------------------------------- subgroups

def _subgroup_work(rank, n, members):
    import torch.distributed as dist
    grp = dist.new_group(members)
    other = dist.new_group([r for r in range(n) if r not in members])   # every rank must create every group
    if rank not in members:
        # the complementary group runs a collective at the same time, on its own communicator
        t = torch.full((3,), rank + 1)
        P.all_reduce(t, group=other, algorithm="ring")
        return [] if t.tolist() == [sum(r + 1 for r in range(n) if r not in members)] * 3 else ["other group wrong"], {}
    comm = P.get_comm(grp)
    assert comm.size == len(members) and comm.rank == sorted(members).index(rank)
    return C.matrix(comm, [0, 1, 7, 1000], group=grp, to_global=lambda g: sorted(members)[g])


def test_subgroup_with_global_src_dst(spawn):
    """group=dist.new_group([1, 3, 4]) on 5 ranks: src/dst are GLOBAL ranks, as in torch."""
    members = [1, 3, 4]
    results = spawn(_subgroup_work, 5, args=(members,))
    _assert_clean(results)
    in_group = [results[r] for r in members]
    _assert_allreduce_identical(in_group)
    _assert_identities(in_group, len(members))


# ----------------------------------------------------------------------------- handshake vs data

def _handshake_traffic_work(rank, n):
    out = []
    for hs in (True, False):
        P.set_handshake(hs)
        for name, call in (("all_reduce", lambda: P.all_reduce(torch.ones(1000), algorithm="ring")),
                           ("broadcast", lambda: P.broadcast(torch.ones(1000), 0, algorithm="tree"))):
            c0 = LEDGER.control.copy()
            with LEDGER.track() as d:
                call()
            dc = LEDGER.control - c0
            out.append((name, hs, (d.msgs_sent, d.bytes_sent, d.msgs_recv, d.bytes_recv),
                        (dc.msgs_sent, dc.bytes_sent), LEDGER.calls[-1].counts.bytes_sent))
    # a small call with the check on, algorithm auto
    P.set_handshake(True)
    x = torch.full((1000,), float(rank))
    c0 = LEDGER.control.copy()
    with LEDGER.track() as d:
        P.all_reduce(x)
    dc = LEDGER.control - c0
    fused = (LEDGER.calls[-1].algorithm, (d.msgs_sent, d.bytes_sent, d.msgs_recv, d.bytes_recv),
             (dc.msgs_sent, dc.bytes_sent), x[0].item())
    P.set_handshake(True)
    return out, fused


def test_handshake_is_control_traffic_not_data(spawn):
    n = 3
    results = spawn(_handshake_traffic_work, n)
    from primitives.engine.algos import HEADER_BYTES
    for rank, (rows, fused) in enumerate(results):
        by = {(name, hs): (data, ctrl, per_call) for name, hs, data, ctrl, per_call in rows}
        for name in ("all_reduce", "broadcast"):
            on, off = by[(name, True)], by[(name, False)]
            assert on[0] == off[0], f"rank {rank} {name}: data counts change with the handshake: {on[0]} vs {off[0]}"
            assert on[2] == on[0][1], "the per-call record holds the data bytes only"
            # the check: one envelope to each of the N-1 peers, a header plus (inband.py) at most
            # the algorithm's first message to that peer (counted as data too)
            assert on[1][0] == n - 1 and (n - 1) * HEADER_BYTES <= on[1][1] <= (n - 1) * (HEADER_BYTES + 4000), \
                f"rank {rank}: check traffic {on[1]}"
            assert off[1] == (0, 0), "no control traffic with the handshake off"
        algo, data, ctrl, value = fused
        assert value == sum(range(n)), fused
        assert ctrl[0] == n - 1, f"rank {rank}: one envelope per peer: {ctrl}"


# ----------------------------------------------------------------------------- async

def _async_work(rank, n):
    ts = [torch.full((257,), float(rank + i)) for i in range(4)]
    handles = [P.all_reduce(t, async_op=True, algorithm=a)
               for t, a in zip(ts, ["ring", "recursive_doubling", "rabenseifner", "linear"])]
    assert all(h is not None and hasattr(h, "wait") for h in handles)
    # a sync call after async ones must wait for them (same communicator, same order on every rank)
    x = torch.full((5,), float(rank))
    P.broadcast(x, n - 1)
    sync_done_flags = [h.is_completed() for h in handles]
    for h in reversed(handles):                        # waiting out of order is fine
        h.wait()
    y = torch.full((3,), 2.0 ** rank)
    h = P.all_reduce(y, op=P.ReduceOp.MAX, async_op=True)
    h.wait()
    return [t[0].item() for t in ts], x.tolist(), sync_done_flags, y.tolist()


def test_async_queue_in_order(spawn):
    n = 3
    results = spawn(_async_work, n)
    for rank, (sums, bx, flags, y) in enumerate(results):
        assert sums == [sum(r + i for r in range(n)) for i in range(4)], f"rank {rank}: {sums}"
        assert bx == [float(n - 1)] * 5
        assert all(flags), "a sync collective returned before the async ones queued before it"
        assert y == [2.0 ** (n - 1)] * 3


# ----------------------------------------------------------------------------- the textbook alone

def _textbook_work(rank, n):
    """The textbook Communicator (primitives/comm.py, no engine wrapped around it) and the engine's
    checked call run the same algorithm functions: results are bitwise equal, every algorithm."""
    import sys

    from primitives.comm import TorchComm
    tb, eng = TorchComm(), P.get_comm()
    assert isinstance(eng, P.Communicator) and type(tb).all_reduce is not type(eng).all_reduce
    g = torch.Generator().manual_seed(rank)
    errs = []
    x = torch.randn(1001, generator=g)
    for algo in ("linear", "ring", "direct", "one_shot", "recursive_doubling", "rabenseifner"):
        a, b = x.clone(), x.clone()
        tb.all_reduce(a, "sum", algorithm=algo)
        eng.all_reduce(b, "sum", algorithm=algo)
        errs += [] if torch.equal(a, b) else [f"all_reduce {algo}"]
    for algo in ("linear", "ring", "tree"):
        a = x.clone() if rank == 1 % n else torch.zeros(1001)
        b = a.clone()
        tb.broadcast(a, 1 % n, algorithm=algo)
        eng.broadcast(b, 1 % n, algorithm=algo)
        errs += [] if torch.equal(a, b) else [f"broadcast {algo}"]
    for algo in ("linear", "ring", "direct"):
        a, b = torch.empty(n * 7), torch.empty(n * 7)
        tb.all_gather_single(a, x[:7], algorithm=algo)
        eng.all_gather_single(b, x[:7], algorithm=algo)
        errs += [] if torch.equal(a, b) else [f"all_gather {algo}"]
        a, b = torch.empty(5), torch.empty(5)
        tb.reduce_scatter_single(a, x[:5 * n], "avg", algorithm=algo)
        eng.reduce_scatter_single(b, x[:5 * n], "avg", algorithm=algo)
        errs += [] if torch.equal(a, b) else [f"reduce_scatter {algo}"]
    for algo in ("linear", "pairwise"):
        inp = torch.arange(3 * n, dtype=torch.float32) + 100 * rank
        a, b = torch.empty(3 * n), torch.empty(3 * n)
        tb.all_to_all_single(a, inp, algorithm=algo)
        eng.all_to_all_single(b, inp, algorithm=algo)
        errs += [] if torch.equal(a, b) else [f"all_to_all {algo}"]
    return errs, sorted(m for m in sys.modules if m.startswith("primitives.") and ".engine" not in m)


@pytest.mark.parametrize("n", [2, 3])
def test_textbook_communicator_matches_engine(spawn, n):
    for errs, _ in spawn(_textbook_work, n):
        assert not errs, errs


def _trace_ring(rank, n):
    """A default-path primitives.all_reduce(t, algorithm="ring"): which functions ran."""
    import sys

    from primitives.all_reduce import ring, ring_all_gather, ring_reduce_scatter
    from primitives.ops import chunk_bounds, combine_
    ran = set()

    def prof(frame, event, arg):
        if event == "call":
            ran.add(frame.f_code)
    t = torch.arange(10, dtype=torch.float32) + rank
    sys.setprofile(prof)
    try:
        P.all_reduce(t, algorithm="ring")
    finally:
        sys.setprofile(None)
    want = {f.__name__: f.__code__ for f in (ring, ring_reduce_scatter, ring_all_gather, chunk_bounds, combine_)}
    return {name: code in ran for name, code in want.items()}, t.tolist()


def test_default_call_runs_the_textbook_ring(spawn):
    """READING.md's ring (primitives/all_reduce.py::ring) is what algorithm="ring" executes."""
    for ran, t in spawn(_trace_ring, 2):
        assert all(ran.values()), ran
        assert t == [2.0 * i + 1 for i in range(10)]
