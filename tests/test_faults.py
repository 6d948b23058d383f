"""One rank dies; every survivor's PeerError names exactly that rank, once, with the evidence, and
no survivor hangs (primitives/engine/faults.py).

    python -m pytest -q tests/test_faults.py                 (a representative subset: 4 runs)
    python -m pytest -q -m slow tests/test_faults.py         (N = 3, 4 × dead rank × moment × transport)

The moments a rank dies at:
  before   before building its communicator: the survivors wait for it at set-up's arrival round
           (spawn builds one communicator per rank before the test's function runs; every
           moment here is about the fresh one the function builds)
  during   inside set-up: shm: creating or attaching the segment; tcp: right after arriving
  check    in the first call's check round, right after posting its envelopes
  mid      during the ring phase of the second all-reduce (after that call's check round)
  late     before set-up, while another survivor is still starting (it arrives 1 s later)
Short timeouts keep a failure fast; none of these runs waits for a deadline: the evidence (a pid
gone, a connection closed, a report) ends every wait.
"""
import os
import re
import time

import pytest
import torch

import primitives as P
from primitives.engine import registry, shm_segment
from primitives.launch import spawn
from primitives.engine.faults import Rounds

MOMENTS = ("before", "during", "check", "mid", "late")


def _die():
    os._exit(3)


def _dies(rank, n, dead, moment, transport):
    os.environ["RINGZERO_TRANSPORT"] = transport
    if rank == dead:
        if moment in ("before", "late"):
            _die()
        if moment == "during" and transport != "tcp":
            shm_segment.create = shm_segment.attach = lambda *a, **k: _die()
        if moment == "during" and transport == "tcp":
            gather = Rounds.gather
            Rounds.gather = lambda self, obj: (gather(self, obj), _die())
    if moment == "late" and rank == (dead + 1) % n:
        time.sleep(1.0)                      # still starting when the dead rank is already gone
    try:
        registry._COMMS.clear()
        comm = P.get_comm()
        calls = [0]
        if moment in ("check", "mid") and rank == dead:
            # check: call 1's N-1 envelopes leave (the check rides in them), then it dies;
            # mid: call 2's envelopes and one data message leave, then it dies
            (at_call, limit), sent, orig = ((1, n - 1) if moment == "check" else (2, n)), [0], comm._isend

            def isend(t, peer):
                if calls[0] == at_call:
                    sent[0] += 1
                    if sent[0] > limit:
                        _die()
                return orig(t, peer)
            comm._isend = isend
        for _ in range(3):
            calls[0] += 1
            P.all_reduce(torch.ones(40_000), algorithm="ring")   # 160 kB: larger than an envelope
        return "returned", "", None
    except Exception as e:
        return type(e).__name__, str(e), getattr(e, "dead", None)


def named(msg: str) -> list[int]:
    """Every rank a message accuses: its root cause(s), and any 'did rank X die' hint."""
    return [int(x) for x in re.findall(r"(?:Root cause: rank|did rank) (\d+)", msg)]


def kill_matrix(runs, transport="auto"):
    """[(n, dead, moment)] -> (live ranks that named exactly the dead rank, live ranks, problems)."""
    good, total, problems = 0, 0, []
    for n, dead, moment in runs:
        res = spawn(_dies, n, args=(dead, moment, transport), comm_timeout=10, grace=12, allow_fail=True, timeout=60,
                    transport=transport)
        if res[dead] != ("exit", 3):
            problems.append(f"{moment} N={n} dead={dead}: the dead rank reported {res[dead]}")
        for r, (status, value) in enumerate(res):
            if r == dead:
                continue
            total += 1
            etype, msg, d = value if status == "ok" else (status, str(value), None)
            want = [f"rank {r}: ", f"Root cause: rank {dead} died: "]
            if moment == "mid":
                want.append("all_reduce(algorithm=ring) call #2")
            if etype == "PeerError" and d == dead and named(msg) == [dead] and all(w in msg for w in want):
                good += 1
            else:
                problems.append(f"{transport} {moment} N={n} dead={dead} rank {r}: {etype} (names {d}): "
                                f"{msg[:300]} ... {msg[-600:]}")
    return good, total, problems


def _check(runs, transport):
    good, total, problems = kill_matrix(runs, transport)
    print(f"{transport}: {good} of {total} live ranks named exactly the dead rank")    # shown with -s
    assert not problems and good == total, f"{good} of {total} live ranks named exactly the dead rank:\n" + \
        "\n".join(problems[:10])


@pytest.mark.parametrize("transport, runs", [
    ("auto", [(3, 1, "before"), (4, 0, "during"), (3, 2, "mid")]),
    ("tcp", [(3, 0, "check")])])
def test_every_survivor_names_the_dead_rank_subset(transport, runs):
    """Default suite: each moment once, N = 3 and 4, the dead rank varying (the slow test: all)."""
    _check(runs, transport)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_every_survivor_names_the_dead_rank_every_moment(transport):
    """N = 3, 4 × every dead rank × every moment: 18 live ranks per moment, 90 per transport."""
    _check([(n, d, m) for m in MOMENTS for n in (3, 4) for d in range(n)], transport)


def _never_builds(rank, n, absent):
    if rank == absent:
        time.sleep(6)                        # alive, but absent past the others' 2 s deadline
    try:
        registry._COMMS.clear()              # spawn built one for every rank: build a fresh one
        P.get_comm()
        return "returned", "", None
    except Exception as e:
        return type(e).__name__, str(e), getattr(e, "dead", None)


def test_a_rank_that_never_arrives_at_set_up_is_named_at_the_deadline():
    """No evidence of a death (its process is alive): the deadline names the absent rank."""
    res = spawn(_never_builds, 3, args=(2,), comm_timeout=2, grace=2, allow_fail=True, timeout=60)
    for r in (0, 1):
        status, (etype, msg, d) = res[r]
        assert etype == "PeerError" and d == 2 and named(msg) == [2], msg
        assert "Root cause: rank 2 never arrived at the shared-memory rendezvous (set-up round 1) within 2s" in msg, msg


def test_a_rank_dead_before_the_shm_rendezvous_is_named_after_the_store_host_gave_up():
    """env:// start (rank 0 hosts the store), 3 ranks: rank 2 dies before the shared-memory
    rendezvous, rank 1 reaches it a second after rank 0 named rank 2. Both survivors name rank 2
    from the evidence (its pid gone), not from a deadline (RINGZERO_TIMEOUT is 120 s)."""
    import subprocess
    import sys
    from primitives.launch import free_port
    env = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RINGZERO_TIMEOUT="120", OMP_NUM_THREADS="1")
    env.pop("RINGZERO_TRANSPORT", None)
    script = os.path.join(os.path.dirname(__file__), "launch_dying_rank.py")
    procs = [subprocess.Popen([sys.executable, script, "--before-shm"], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(3)]
    outs = [p.communicate(timeout=110)[0] for p in procs]
    assert procs[2].returncode == 3, outs[2]
    for r in (0, 1):
        line = outs[r].strip().splitlines()[-1] if outs[r].strip() else ""
        assert line.startswith("PeerError") and f"rank {r}: " in line, (r, outs[r][-2000:])
        assert named(line) == [2] and "Root cause: rank 2 died: its process" in line, (r, line)
