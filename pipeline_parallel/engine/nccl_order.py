"""Instruction lists that nccl's in-order point-to-point streams cannot deadlock on.

    python -m pytest -q tests/test_pipeline_units.py -k nccl

torch's nccl process group runs ungrouped sends and receives towards one peer in posting order,
and a send completes only once the peer's matching receive runs. The executor posts one op at a
time, so where the k-th ops two ranks post towards each other are both sends (1F1B's steady
state), both wait forever. `legalize_for_nccl` moves one side's receive in front of its send
until simulate(mode="nccl") (pipeline_parallel/engine/simulator.py) passes; the engine uses
`programs(..., backend="nccl")` on nccl and in strict mode (which replays nccl's rules over gloo). Posting both as one group (the Communicator's exchange(),
dist.batch_isend_irecv) is the other cure. For naive, GPipe and 1F1B the reordered lists keep the
formula's bubble; interleaved pays a little (p = 2, m = 4, v = 2: 0.14 instead of 0.11).
Cost: a few simulations per move, once per engine.
"""
from __future__ import annotations

from pipeline_parallel.engine.simulator import simulate
from pipeline_parallel.schedules import build
from pipeline_parallel.schedules.instructions import SENDS, Instruction, ScheduleError, peer

COMPUTE = ("fwd", "bwd")


def programs(name: str, num_stages: int, micro_batches: int, virtual_stages: int = 1, train: bool = True,
             backend: str = "gloo") -> list:
    """Every stage's instruction list; for nccl, receives reordered so per-peer queues pair up."""
    progs = [build(name, s, num_stages, micro_batches, virtual_stages, train) for s in range(num_stages)]
    if backend == "nccl" and num_stages > 1:
        progs = legalize_for_nccl(progs, micro_batches, virtual_stages)
    return progs


def legalize_for_nccl(programs: list[list[Instruction]], micro_batches: int, virtual_stages: int = 1,
                      max_moves: int = 100_000) -> list[list[Instruction]]:
    """Reorder receives so every per-peer queue pairs up under nccl's in-order streams.

    Where the k-th ops two ranks post towards each other are both sends, one of them moves its
    next receive from that peer to just before that send (the peer's matching send is already
    posted, so waiting for it first cannot block). Tries the higher rank first, keeps a move only
    if the simulation gets further, and returns programs that pass simulate(mode="nccl")."""
    progs = [list(ops) for ops in programs]
    p = len(progs)
    for _ in range(max_moves):
        try:
            simulate(progs, micro_batches, virtual_stages, mode="nccl")
            return progs
        except ScheduleError as e:
            err, info = str(e), getattr(e, "unpaired", None)
        if info is None:
            raise ScheduleError(f"cannot order this schedule for nccl: {err}")
        k, *ranks = info
        moved = False
        for r in sorted(set(ranks), reverse=True):
            q = ranks[1] if r == ranks[0] else ranks[0]
            ops = progs[r]
            # the first send towards q that the peer cannot pair yet: the earliest send to q
            # whose position in the queue equals the failing index
            towards = [i for i, o in enumerate(ops) if o.kind in SENDS or o.kind.startswith("recv")
                       if peer(o, r, p) == q]
            if k >= len(towards) or ops[towards[k]].kind not in SENDS:
                continue
            i = towards[k]
            nxt = [j for j in towards if j > i and ops[j].kind.startswith("recv")]
            if not nxt:
                continue
            j = nxt[0]
            if any(ops[t].kind in COMPUTE and (ops[t].mb, ops[t].chunk) == (ops[j].mb, ops[j].chunk)
                   for t in range(i, j)):
                continue
            trial = [list(x) for x in progs]
            trial[r].insert(i, trial[r].pop(j))
            progs = trial
            moved = True
            break
        if not moved:
            raise ScheduleError(f"cannot order this schedule for nccl: {err}")
    raise ScheduleError("cannot order this schedule for nccl: too many moves")
