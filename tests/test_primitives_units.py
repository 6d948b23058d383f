"""Communication-free logic, no processes: chunking, the cost model, "auto", traffic formulas."""
import math

import pytest
import torch

import primitives as P
from primitives.engine.check import op_name
from primitives.engine.cost import Params, choose, predict, traffic
from primitives.ops import chunk_bounds


@pytest.mark.parametrize("numel", [0, 1, 2, 7, 8, 9, 100, 1001])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8])
def test_chunk_bounds_matches_tensor_split(numel, n):
    expected = [(int(c[0]), int(c[-1]) + 1) if c.numel() else None
                for c in torch.arange(numel).tensor_split(n)]
    got = chunk_bounds(numel, n)
    assert len(got) == n
    assert got[0][0] == 0 and got[-1][1] == numel
    for (s, e), exp, (s2, _) in zip(got, expected, got[1:] + [(numel, None)]):
        assert e == s2, "chunks are contiguous and in order"
        if exp is not None:
            assert (s, e) == exp
        else:
            assert s == e
    sizes = [e - s for s, e in got]
    assert max(sizes) - min(sizes) <= 1


def test_op_name_accepts_reduceops_and_rejects_others():
    assert [op_name(o) for o in (P.ReduceOp.SUM, P.ReduceOp.PRODUCT, P.ReduceOp.MIN, P.ReduceOp.MAX,
                                 P.ReduceOp.AVG)] == ["sum", "product", "min", "max", "avg"]
    assert [op_name(o) for o in (P.ReduceOp.BAND, P.ReduceOp.BOR, P.ReduceOp.BXOR)] == ["band", "bor", "bxor"]
    assert op_name("median") is None and op_name(3.5) is None
    assert op_name(torch.distributed._make_nccl_premul_sum(2.0)) is None     # nccl's: refused by name (check.py)


# textbook constants (α 150 µs, β 0.27 ns/B, γ 0.1 ns/B, o = α), not the fitted table: these
# tests are about the model's formulas; tests/test_cost_model.py covers the fit and auto's table
GLOO = Params(alpha=1.5e-4, beta=2.7e-10, gamma=1.0e-10, o=1.5e-4)


def test_predict_latency_vs_bandwidth_crossover_at_4_ranks():
    """Recursive doubling (log2 P messages of the whole buffer) wins for tiny messages; ring
    (2(N-1) messages of S/N) wins for huge ones, as the α-β model says."""
    tiny, huge = 64, 256 << 20
    assert predict("all_reduce", "recursive_doubling", 4, tiny, GLOO) < predict("all_reduce", "ring", 4, tiny, GLOO)
    assert predict("all_reduce", "ring", 4, huge, GLOO) < predict("all_reduce", "recursive_doubling", 4, huge, GLOO)
    # ring, rabenseifner and direct all send the bandwidth-optimal 2(N-1)/N·S bytes
    t = {a: predict("all_reduce", a, 4, huge, GLOO) for a in ("ring", "rabenseifner", "direct", "recursive_doubling")}
    assert min(t, key=t.get) in ("ring", "rabenseifner", "direct")
    # the same crossover for broadcast: a binomial tree for small, the pipelined chain for big
    assert predict("broadcast", "tree", 8, 64, GLOO) < predict("broadcast", "ring", 8, 64, GLOO)
    assert predict("broadcast", "ring", 8, huge, GLOO) < predict("broadcast", "tree", 8, huge, GLOO)


@pytest.mark.parametrize("name", list(P.ALGORITHMS))
def test_predict_is_monotone_in_size_and_zero_for_one_rank(name):
    for algo in P.ALGORITHMS[name]:
        for n in (2, 3, 4, 8):
            ts = [predict(name, algo, n, s, GLOO) for s in (0, 1 << 10, 1 << 16, 1 << 22, 1 << 26)]
            assert all(a <= b for a, b in zip(ts, ts[1:])), (algo, n, ts)
            assert ts[-1] > 0
        assert predict(name, algo, 1, 1 << 20, GLOO) == 0.0


@pytest.mark.parametrize("backend", ["gloo", "mpi", "nccl", "unknown"])
def test_choose_returns_a_valid_algorithm_everywhere(backend):
    for name, algos in P.ALGORITHMS.items():
        for n in range(1, 17):
            for nbytes in (0, 1, 4096, 1 << 20, 1 << 26):
                a = choose(name, n, nbytes, backend)
                assert a in algos, (name, n, nbytes, a)
                # linear is the naive baseline: auto never picks it beyond 2 ranks (all-to-all's
                # linear posts everything at once, which is not naive: it may be chosen)
                assert n <= 2 or a != "linear" or name.startswith("all_to_all")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_traffic_sums_match_closed_forms(n):
    """Summed over ranks, traffic() gives the textbook totals (independent of the per-rank detail)."""
    numel, elem = 1000, 4
    S = numel * elem
    tot = lambda name, algo, root=0: [sum(x) for x in zip(*(traffic(name, algo, n, r, numel, elem, root) for r in range(n)))]  # noqa: E731
    p2 = 1 << (n.bit_length() - 1)
    rem, lg = n - p2, int(math.log2(p2))
    assert tot("all_reduce", "ring") == [2 * n * (n - 1), 2 * (n - 1) * S]
    assert tot("all_reduce", "linear") == [2 * (n - 1), 2 * (n - 1) * S]
    assert tot("all_reduce", "recursive_doubling") == [p2 * lg + 2 * rem, (p2 * lg + 2 * rem) * S]
    assert tot("all_reduce", "rabenseifner")[1] == (2 * (p2 - 1) + 2 * rem) * S
    for root in range(n):
        for algo in ("linear", "tree"):
            assert tot("broadcast", algo, root) == [n - 1, (n - 1) * S]
            assert tot("reduce", algo, root) == [n - 1, (n - 1) * S]
        assert tot("scatter", "ring", root) == [n * (n - 1) // 2, n * (n - 1) // 2 * S]
        assert tot("gather", "ring", root) == [n * (n - 1) // 2, n * (n - 1) // 2 * S]
        assert tot("scatter", "tree", root)[0] == n - 1
        assert tot("gather", "tree", root)[1] == tot("scatter", "tree", root)[1]
    for name in ("all_gather", "all_gather_single", "reduce_scatter", "reduce_scatter_single"):
        assert tot(name, "ring") == [n * (n - 1), n * (n - 1) * S]
    assert tot("all_gather", "linear") == [(n - 1) ** 2 + n - 1, ((n - 1) ** 2 + n - 1) * S]
    # nothing moves for one rank or an empty tensor
    assert all(traffic(name, a, 1, 0, numel, elem) == (0, 0) for name, al in P.ALGORITHMS.items() for a in al)
    assert all(traffic(name, a, n, 0, 0, elem) == (0, 0) for name, al in P.ALGORITHMS.items() for a in al)


def test_ring_all_reduce_bytes_per_rank_follow_chunk_rounding():
    """2(N-1)/N·S up to tensor_split's rounding: between 2(N-1)⌊numel/N⌋ and 2(N-1)⌈numel/N⌉ elements."""
    for n in (3, 5, 7):
        for numel in (n - 1, n + 1, 10 * n + 3):
            for r in range(n):
                msgs, nbytes = traffic("all_reduce", "ring", n, r, numel, 1)
                assert 2 * (n - 1) * (numel // n) <= nbytes <= 2 * (n - 1) * -(-numel // n)


def test_all_reduce_coalesced_equals_one_call_per_tensor(spawn):
    spawn(_coalesced_body, 3)


def _coalesced_body(rank, world):
    import torch
    from primitives import get_comm
    from primitives.coalesced import all_reduce_coalesced
    g = torch.Generator().manual_seed(rank)
    ts = [torch.randn(5, generator=g), torch.randn(2, 3, generator=g), torch.randn(1, generator=g)]
    one_by_one = [t.clone() for t in ts]
    comm = get_comm()
    for t in one_by_one:
        comm.all_reduce(t, "avg", algorithm="ring")
    all_reduce_coalesced(comm, ts, "avg")
    for a, b in zip(ts, one_by_one):
        # same elements, same summation order per element only if chunking agrees; values agree to rounding
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a, b)


def test_textbook_loads_no_engine_module():
    """Importing every textbook file of primitives loads nothing under primitives/engine/; the
    package's drop-in names still resolve (lazily) to the engine's functions."""
    import subprocess
    import sys
    code = ("import sys, primitives.comm, primitives.ops, primitives.all_reduce, primitives.broadcast, "
            "primitives.reduce, primitives.all_gather, primitives.reduce_scatter, primitives.scatter, "
            "primitives.gather, primitives.all_to_all, primitives.coalesced, primitives.mesh\n"
            "assert not [m for m in sys.modules if '.engine' in m], [m for m in sys.modules if '.engine' in m]\n"
            "import primitives as P\n"
            "assert P.all_reduce.__module__ == 'primitives.engine.api' and callable(P.broadcast)\n"
            "assert sys.modules['primitives.all_reduce'].ring.__module__ == 'primitives.all_reduce'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _recorded(rank, n):
    from primitives.engine.recording import Recording
    rec = Recording(P.get_comm())
    x = torch.arange(6 * n, dtype=torch.float32) + rank
    with P.LEDGER.track() as d:
        P.all_reduce(x, group=rec, algorithm="ring")
    data = rec.sends()
    return (len(data), sum(m.nbytes for m in data), d.msgs_sent, d.bytes_sent,
            len(rec.sends(data_only=False)) - len(data), sorted({m.peer for m in data}), x.tolist())


def test_recording_communicator_logs_what_the_ledger_counts(spawn):
    """A ring all-reduce through the recording Communicator: its data messages are the ledger's
    (2(N-1) per rank, to the next rank only), the check round's envelopes are logged as control,
    and the result is the all-reduce's."""
    n = 3
    for rank, (msgs, nbytes, led_msgs, led_bytes, control, peers, x) in enumerate(spawn(_recorded, n)):
        assert (msgs, nbytes) == (led_msgs, led_bytes) == (2 * (n - 1), 2 * (n - 1) * 6 * 4), rank
        assert control == n - 1 and peers == [(rank + 1) % n], (rank, control, peers)
        assert x == [float(3 * i + sum(range(n))) for i in range(6 * n)]


def test_ring_reduce_scatter_keeps_one_scratch_block_per_step_up_to_two(spawn):
    # N − 1 steps use their receive blocks in turn: one at N = 2, two from N = 3 (planner.memory counts these)
    for n in (2, 3):
        assert spawn(_ring_rs_scratch, n) == [min(2, n - 1)] * n


def _ring_rs_scratch(rank, world):
    import torch
    from primitives import get_comm
    comm = get_comm()
    blocks = [torch.full((6,), float(rank + 10 * b)) for b in range(world)]
    out = torch.empty(6)
    comm.reduce_scatter(out, blocks, algorithm="ring")
    assert torch.equal(out, torch.full((6,), float(sum(range(world)) + 10 * rank * world))), out
    return sum(1 for (_, dtype, slot) in comm.__dict__.get("_scratch", {}) if dtype == torch.float32 and slot in (0, 1))
