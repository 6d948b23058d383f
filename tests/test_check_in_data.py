"""The call check rides in the algorithm's first messages (primitives/engine/inband.py): results
stay bitwise those of gloo for messages inside and behind the envelopes, a mismatch at sizes
where the data does not fit an envelope is still a CollectiveError on EVERY rank (also ranks
that never talk to the bad one), and the communicator works afterwards, on both transports.

    python -m pytest -q tests/test_check_in_data.py
"""
import pytest
import torch

import primitives as P
from primitives.ops import chunk_bounds
from primitives.engine.algos import HEADER_BYTES
from primitives.engine.inband import INLINE
from primitives.engine.ledger import LEDGER

import collective_checks as C
from test_primitives_collectives import _assert_allreduce_identical, _assert_clean

BIG = INLINE // 8 * 3 + 5        # int64 elements: every algorithm's first message is behind its envelope


def _matrix(rank, n):
    return C.matrix(P.get_comm(), [7, BIG], dtype=torch.int64, ops=("sum",),
                    names=["all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single", "gather", "scatter"])


@pytest.mark.slow                     # ~30 s under load; the default matrix covers the small sizes
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_results_with_the_check_in_the_data(spawn, transport):
    results = spawn(_matrix, 3, transport=transport)
    _assert_clean(results)
    _assert_allreduce_identical(results)


def _mismatches(rank, n):
    big = torch.ones(BIG)
    cases = [   # (label, call, words every rank's error must hold)
        ("size on one rank", lambda: P.all_reduce(torch.ones(BIG + (rank == 2)), algorithm="ring"),
         ["disagree", f"numel={BIG + 1}", f"numel={BIG}"]),
        ("algorithm on one rank", lambda: P.all_reduce(big.clone(), algorithm="rabenseifner" if rank == 1 else "ring"),
         ["disagree", "algorithm=rabenseifner", "algorithm=ring"]),
        ("another collective", lambda: (P.all_gather_single(torch.zeros(BIG * n), big.clone(), algorithm="ring")
                                        if rank == 3 else P.all_reduce(big.clone(), algorithm="ring")),
         ["disagree", "call=all_gather_single", "call=all_reduce"]),
        ("root", lambda: P.broadcast(big.clone(), 1 if rank == 2 else 0, algorithm="ring"), ["disagree", "root="]),
        ("bad argument on one rank", lambda: P.all_reduce(big.clone(), algorithm="tree" if rank == 0 else "ring"),
         ["rank(s) [0]" if rank else "'tree'", "'algorithm'"]),
    ]
    out = []
    for label, call, words in cases:
        try:
            call()
            out.append((label, "no error", "", words))
        except Exception as e:
            out.append((label, type(e).__name__, str(e), words))
    x = torch.full((BIG,), float(rank + 1))
    P.all_reduce(x, algorithm="ring")             # nothing of the aborted calls is left in flight
    return out, x[:3].tolist() + x[-3:].tolist()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_big_mismatch_raises_on_every_rank(spawn, transport):
    n = 4
    problems = []
    for rank, (rows, after) in enumerate(spawn(_mismatches, n, transport=transport, comm_timeout=20)):
        assert after == [float(sum(range(1, n + 1)))] * 6, f"rank {rank}: the communicator is broken: {after}"
        for label, etype, msg, words in rows:
            missing = [w for w in [f"rank {rank}"] + words if w not in msg]
            if etype != "CollectiveError" or missing:
                problems.append(f"[{label}] rank {rank}: {etype} lacking {missing}: {msg[:300]}")
    assert not problems, "\n".join(problems)


def _traffic(rank, n):
    out = {}
    for hs in (True, False):
        P.set_handshake(hs)
        for numel in (100, INLINE):
            x = torch.full((numel,), float(rank))
            d0, c0 = LEDGER.data.copy(), LEDGER.control.copy()
            P.all_reduce(x, algorithm="ring")
            d, c = LEDGER.data - d0, LEDGER.control - c0
            out[(hs, numel)] = ((d.msgs_sent, d.bytes_sent, d.msgs_recv, d.bytes_recv),
                                (c.msgs_sent, c.bytes_sent), x[0].item())
    P.set_handshake(True)
    return out


def test_the_check_adds_envelopes_not_rounds(spawn):
    """Same data messages with the check on and off; the check is N-1 envelopes per rank, each
    a header plus (small calls) the first message itself."""
    n = 3
    for rank, out in enumerate(spawn(_traffic, n, transport="tcp")):
        for numel in (100, INLINE):
            on, off = out[(True, numel)], out[(False, numel)]
            assert on[0] == off[0] and on[2] == off[2] == sum(range(n)), (rank, numel, on, off)
            assert off[1] == (0, 0)
            lo, hi = chunk_bounds(numel, n)[rank]        # the ring's first message: chunk r, inline if it fits
            chunk = (hi - lo) * 4
            first = chunk if chunk <= INLINE else 0
            assert on[1] == (n - 1, HEADER_BYTES * (n - 1) + first), (rank, numel, on[1])
