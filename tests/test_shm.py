"""The shared-memory transport (primitives/engine/shm.py, shm_segment.py, shm_collectives.py).

The whole collectives matrix (tests/test_primitives_collectives.py, test_primitives_errors.py)
already runs on it: RINGZERO_TRANSPORT defaults to auto, which is shm on one host, and
collective_checks.algorithms() adds algorithm="shm" there. Here: what is specific to it
(multi-round native collectives, a rank killed mid-collective, no segment left behind, stale
segments, refusals) and a reduced run on the TCP transport so that path stays tested too.
"""
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

import primitives as P
from primitives.engine import shm_segment as seg
from primitives.engine.shm import ShmComm

import collective_checks as C
from test_primitives_collectives import _assert_allreduce_identical, _assert_clean, _assert_identities


def _transport_matrix(rank, n, numels, dtype, ops, names):
    comm = P.get_comm()
    errs, cases = C.matrix(comm, numels, dtype=dtype, ops=ops, names=names)
    if comm.transport != os.environ["RINGZERO_TRANSPORT"]:
        errs.append(f"rank {rank}: transport {comm.transport}, asked for {os.environ['RINGZERO_TRANSPORT']}")
    return errs, cases


def test_tcp_transport_reduced_matrix(spawn):
    """RINGZERO_TRANSPORT=tcp: gloo point-to-point, every collective × algorithm, bitwise vs gloo."""
    results = spawn(_transport_matrix, 3, args=([0, 7, 1001], torch.int64, ("sum",), None), transport="tcp")
    _assert_clean(results)
    _assert_allreduce_identical(results)
    _assert_identities(results, 3)


NATIVE = ["all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather", "reduce_scatter"]


def _native_rounds(rank, n, numel):
    from primitives.engine import shm_collectives
    comm = P.get_comm()
    assert comm.transport == "shm", comm.transport
    shm_collectives.state(comm).W = 96 << 10         # rounds of 96 KiB: several of them
    errs, cases = [], {}
    for i, (dtype, op) in enumerate([(torch.float32, "sum"), (torch.int32, "max"), (torch.bfloat16, "avg")]):
        for name in NATIVE:
            k = numel if name == "all_reduce" else numel // n
            e, info = C.check_case(comm, name, "shm", numel=k, dtype=dtype, op=op, seed=10 * i)
            errs += e
            cases[(name, "shm", k, op, "contig", 0, str(dtype))] = info
    return errs, cases


def test_shm_native_collectives_in_several_rounds(spawn):
    """Buffers larger than the workspace go in rounds (2-5 here): float32 SUM within the order
    bound, int32 MAX bitwise, bf16 AVG, a ragged tail, the ledger equal to "direct"'s formula."""
    numel = 100_003
    results = spawn(_native_rounds, 3, args=(numel,), transport="shm")
    _assert_clean(results)
    for key in results[0][1]:
        if key[0] == "all_reduce":
            assert len({res[1][key]["digest"] for res in results}) == 1, f"{key}: ranks differ bitwise"


def _killed_mid_collective(rank, n):
    comm = P.get_comm()
    token = comm.token
    if rank == 1:
        from primitives.engine import shm_collectives
        calls = [0]
        st = shm_collectives.state(comm)
        orig = st.wait

        def wait(*args, **kw):                           # SIGKILL (no cleanup at all) mid all-reduce
            calls[0] += 1
            if calls[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            orig(*args, **kw)
        st.wait = wait
    t0 = time.monotonic()
    try:
        P.all_reduce(torch.zeros(3 << 20), algorithm="shm")    # 12 MiB: several rounds
        return ("returned", time.monotonic() - t0, "", token)
    except Exception as e:
        return (type(e).__name__, time.monotonic() - t0, str(e), token)


def test_rank_killed_mid_collective_named_and_no_segment_left():
    from primitives.launch import spawn
    comm_timeout = 20.0
    res = spawn(_killed_mid_collective, 3, comm_timeout=comm_timeout, grace=comm_timeout + 10, allow_fail=True,
                timeout=90, transport="shm")
    assert res[1] == ("exit", -signal.SIGKILL), res[1]
    for r in (0, 2):
        status, (etype, secs, msg, token) = res[r]
        assert status == "ok" and etype == "PeerError", res[r]
        assert "rank 1" in msg and "is gone" in msg and f"rank {r}: failed" in msg, msg
        assert secs < 5, f"rank {r} took {secs:.1f}s to notice (liveness is checked every 50 ms)"
    assert seg.listing(res[0][1][3]) == [], "a segment of the run outlived it"


def _noop(rank, n):
    return P.get_comm().transport


def test_stale_segment_of_a_dead_run_is_removed_a_live_one_kept(spawn):
    dead = subprocess.Popen(["true"])
    dead.wait()
    uid = os.getuid()
    stale = f"{seg.PREFIX}{uid}-{dead.pid}.1-deadbeef-h0"          # its creator is gone
    live = f"{seg.PREFIX}{uid}-{os.getpid()}.{seg.start_time(os.getpid())}-cafef00d-h0"   # ours: alive
    for name in (stale, live):
        with open(os.path.join(seg.SHM_DIR, name), "wb") as f:
            f.write(b"x" * 64)
    try:
        assert spawn(_noop, 2, transport="auto") == ["shm", "shm"]
        left = os.listdir(seg.SHM_DIR)
        assert stale not in left, "the stale segment of a crashed run was not removed"
        assert live in left, "a segment whose creator is alive was removed"
    finally:
        for name in (stale, live):
            seg.unlink(name)


def _refusals(rank, n):
    out = []
    try:
        P.all_reduce(torch.ones(4), algorithm="shm")
        out.append("no error")
    except P.CollectiveError as e:
        out.append(str(e))
    return P.get_comm().transport, out


def test_algorithm_shm_on_tcp_is_refused_on_every_rank(spawn):
    for transport, msgs in spawn(_refusals, 2, transport="tcp"):
        assert transport == "tcp"
        assert "'shm'" in msgs[0] and "transport is 'tcp'" in msgs[0], msgs


def test_unknown_transport_is_refused():
    from primitives.engine.shm import transport_from_env
    with pytest.raises(ValueError, match="expected one of"):
        transport_from_env("infiniband")
    assert transport_from_env("SHM") == "shm"


def test_auto_on_shm_picks_the_shm_collectives_and_the_ledger_formula_follows():
    """No processes: the cost model of this transport, and traffic() for algorithm="shm"."""
    from primitives.engine.cost import choose, traffic
    from primitives.engine.shm_collectives import ONE_SHOT_BYTES
    for name in ("all_reduce", "all_gather", "reduce_scatter_single"):
        for nbytes in (8, 4096, 1 << 20, 1 << 26):
            assert choose(name, 4, nbytes, "gloo", "shm") == "shm", (name, nbytes)
            assert choose(name, 4, nbytes, "gloo", "tcp") != "shm"
    small, big = ONE_SHOT_BYTES // 8, (ONE_SHOT_BYTES // 8) * 4 + 3          # int64 elements
    assert traffic("all_reduce", "shm", 4, 1, small, 8) == (3, 3 * small * 8)   # one-shot: 3 peers read all
    assert traffic("all_reduce", "shm", 4, 1, big, 8) == traffic("all_reduce", "direct", 4, 1, big, 8)
    assert traffic("all_gather", "shm", 4, 2, 100, 4) == (3, 1200)


def test_a_wait_stops_yielding_after_a_yield_that_ran_another_jobs_slice(monkeypatch):
    """ShmComm.spin_until with ranks outnumbering cores: it yields first; a yield that came back only
    after more than shm_segment.YIELD_SLOW (here: a stub yield that sleeps 3 ms, standing for another
    job's time slice) turns the yields off for a second, so the next wait sleeps on its futex at once."""
    calls = []
    monkeypatch.setattr(os, "sched_yield", lambda: (calls.append("yield"), time.sleep(3e-3)))
    monkeypatch.setattr(seg, "futex_wait", lambda *a: calls.append("sleep"))
    comm = ShmComm.__new__(ShmComm)      # the wait loop's state only: no process group, no segment
    comm.rank, comm.local, comm.L, comm._base, comm.timeout = 0, {0: 0}, {"ctl": 64}, 0, 60.0
    comm.i32, comm.spin, comm.yield_s, comm.calm = np.zeros(64, dtype=np.int32), 2, 5e-4, 0.0
    comm._check_peers = lambda *a: None

    def after(k):                         # ready on the k-th poll
        polls = iter(range(k, 0, -1))
        return lambda: next(polls) == 1
    comm.spin_until(after(4), 1, "waiting for")
    assert calls[0] == "yield" and comm.calm > time.monotonic()     # one slow yield: yields off
    del calls[:]
    comm.spin_until(after(5), 1, "waiting for")
    assert calls and "yield" not in calls and calls[0] == "sleep", calls
