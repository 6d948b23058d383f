"""Instructions, and a simulator that checks any schedule without processes.

    python -m pipeline_parallel.schedules             # every schedule's simulated bubble, p = 4, m = 8

A schedule is a pure function (stage, num_stages, micro_batches[, virtual_stages]) -> list[Op].
Op kinds, for micro-batch `mb` on local model chunk `chunk` (virtual stage g = chunk·p + stage):
  recv_act  fwd  send_act        forward of one micro-batch through one chunk
  recv_grad bwd  send_grad       its backward
  reduce_tied  reduce_grads  step   once per batch, after the last backward
The executor (pipeline_parallel/executor.py) runs the list in order: sends are posted and not
waited for until the end of the step, receives are waited for at once.

Deadlock rule. The executor posts sends without waiting (their waits come at the end of the
step) and waits for each receive at once; the simulator's default "buffered" mode models exactly
that, and every schedule here completes under it for every p, m, v the tests try. This is what
gloo provides. nccl is stricter: ungrouped p2p ops to one peer run in posting order on one
stream, so where stage s posts send→s+1 then recv←s+1 while s+1 posts send→s then recv←s
(1F1B's steady state), the k-th ops of the two queues are both sends and both wait. The
simulator's "nccl" mode checks exactly that pairing; the fix is to post such an exchange as one
group (the grouped p2p API being added to the Communicator) — until it lands the engine refuses
nccl for schedules that fail the "nccl" check (tests/test_pipeline_schedules.py lists them).
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("fwd", "bwd")
SENDS = {"send_act": "recv_act", "send_grad": "recv_grad"}
FINAL = ("reduce_tied", "reduce_grads", "step")


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Op:
    kind: str
    mb: int = -1
    chunk: int = 0

    def __repr__(self):
        return f"{self.kind}({self.mb},{self.chunk})" if self.mb >= 0 else self.kind


def check_args(name: str, stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ScheduleError(f"{name}: num_stages must be a positive int, got {num_stages!r}")
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ScheduleError(f"{name}: stage must be in 0..{num_stages - 1}, got {stage!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ScheduleError(f"{name}: micro_batches (gradient_accumulation_steps) must be >= 1, got {micro_batches!r}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ScheduleError(f"{name}: virtual_stages must be >= 1, got {virtual_stages!r}")


def fwd_ops(mb: int, chunk: int, stage: int, p: int, v: int = 1) -> list[Op]:
    g = chunk * p + stage
    return ([Op("recv_act", mb, chunk)] if g > 0 else []) + [Op("fwd", mb, chunk)] + \
           ([Op("send_act", mb, chunk)] if g < p * v - 1 else [])


def bwd_ops(mb: int, chunk: int, stage: int, p: int, v: int = 1) -> list[Op]:
    g = chunk * p + stage
    return ([Op("recv_grad", mb, chunk)] if g < p * v - 1 else []) + [Op("bwd", mb, chunk)] + \
           ([Op("send_grad", mb, chunk)] if g > 0 else [])


def peer(op: Op, stage: int, p: int) -> int:
    """The pipeline rank a send/recv talks to."""
    down = op.kind in ("send_act", "recv_grad")
    return (stage + (1 if down else -1)) % p


def finish(ops: list[Op], train: bool = True) -> list[Op]:
    return ops + ([Op(k) for k in FINAL] if train else [])


def _msg(op: Op, stage: int, p: int):
    """(kind, mb, virtual boundary) — the same key on the sending and the receiving rank."""
    g = op.chunk * p + stage
    if op.kind in ("send_act", "recv_act"):
        return ("act", op.mb, g if op.kind == "send_act" else g - 1)
    return ("grad", op.mb, g - 1 if op.kind == "send_grad" else g)


def simulate(programs: list[list[Op]], micro_batches: int, virtual_stages: int = 1, *,
             t_fwd: float = 1.0, t_bwd: float = 2.0, mode: str = "buffered") -> dict:
    """Run one program per rank on a logical clock (compute takes t_fwd / t_bwd, messages are
    free). mode "buffered": sends never block (gloo); "nccl": the k-th op a rank posts towards a peer
    must pair with the peer's k-th op towards it (a send with the matching receive).
    Checks every dependency and that each (micro-batch, chunk) runs forward and backward once.
    Returns per-rank busy time, makespan, bubble fraction and peak stored activations."""
    p, v, m = len(programs), virtual_stages, micro_batches
    pc, clock = [0] * p, [0.0] * p
    sent: dict = {}                    # message key -> time it became available
    done_f, done_b, live, peak = [set() for _ in range(p)], [set() for _ in range(p)], [0] * p, [0] * p
    got: list[set] = [set() for _ in range(p)]
    busy = [0.0] * p
    events: list[list[tuple]] = [[] for _ in range(p)]
    queue: dict = {}                   # nccl mode: (rank, peer) -> ops posted towards that peer
    comp: dict = {}                    # nccl mode: rank pair -> completion time of each paired op
    posted = [-1] * p

    def step(r) -> bool:
        op = programs[r][pc[r]]
        key = (op.mb, op.chunk)
        g = op.chunk * p + r
        if op.kind == "fwd":
            if g > 0 and ("act", key) not in got[r]:
                raise ScheduleError(f"stage {r}: {op} before its activation was received")
            if key in done_f[r]:
                raise ScheduleError(f"stage {r}: {op} runs twice")
            done_f[r].add(key)
            live[r] += 1
            peak[r] = max(peak[r], live[r])
            events[r].append(("fwd", clock[r], clock[r] + t_fwd, op.mb, op.chunk))
            clock[r] += t_fwd
            busy[r] += t_fwd
        elif op.kind == "bwd":
            if key not in done_f[r] or (g < p * v - 1 and ("grad", key) not in got[r]):
                raise ScheduleError(f"stage {r}: {op} before its forward / its gradient")
            if key in done_b[r]:
                raise ScheduleError(f"stage {r}: {op} runs twice")
            done_b[r].add(key)
            live[r] -= 1
            events[r].append(("bwd", clock[r], clock[r] + t_bwd, op.mb, op.chunk))
            clock[r] += t_bwd
            busy[r] += t_bwd
        elif op.kind in SENDS:
            need = done_f[r] if op.kind == "send_act" else done_b[r]
            if key not in need:
                raise ScheduleError(f"stage {r}: {op} before the tensor it sends exists")
            sent[_msg(op, r, p)] = clock[r]
            if mode == "nccl":
                queue.setdefault((r, peer(op, r, p)), []).append((op, clock[r]))
                advance(r, peer(op, r, p))
        elif op.kind in ("recv_act", "recv_grad"):
            msg = _msg(op, r, p)
            if mode == "nccl":
                q = peer(op, r, p)
                mine = queue.setdefault((r, q), [])
                if posted[r] != pc[r]:           # post once, then wait for it
                    posted[r] = pc[r]
                    mine.append((op, clock[r]))
                    advance(r, q)
                idx = len(mine) - 1
                pair = (min(r, q), max(r, q))
                if idx >= len(comp.get(pair, [])):
                    return False
                clock[r] = max(clock[r], comp[pair][idx])
            else:
                if msg not in sent:
                    return False
                clock[r] = max(clock[r], sent[msg])
            got[r].add(("act" if op.kind == "recv_act" else "grad", key))
        pc[r] += 1
        return True

    def advance(r, q):
        """nccl: the k-th op r posted towards q pairs with the k-th op q posted towards r."""
        pair = (min(r, q), max(r, q))
        done = comp.setdefault(pair, [])
        a, b = queue.get((r, q), []), queue.get((q, r), [])
        while len(a) > len(done) and len(b) > len(done):
            (x, tx), (y, ty) = a[len(done)], b[len(done)]
            if not ((x.kind in SENDS and SENDS[x.kind] == y.kind and _msg(x, r, p) == _msg(y, q, p)) or
                    (y.kind in SENDS and SENDS[y.kind] == x.kind and _msg(y, q, p) == _msg(x, r, p))):
                e = ScheduleError(f"nccl: op #{len(done)} between ranks {r} and {q} is {x} on rank {r} "
                                  f"but {y} on rank {q}: they do not pair, both wait")
                e.unpaired = (len(done), r, q)
                raise e
            done.append(max(tx, ty, done[-1] if done else 0.0))

    while any(pc[r] < len(programs[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pc[r] < len(programs[r]) and step(r):
                progressed = True
        if not progressed:
            stuck = {r: programs[r][pc[r]] for r in range(p) if pc[r] < len(programs[r])}
            raise ScheduleError(f"deadlock ({mode}): ranks blocked at {stuck}")
    for r in range(p):
        want = {(mb, c) for mb in range(m) for c in range(v)}
        if done_f[r] != want or done_b[r] != want:
            raise ScheduleError(f"stage {r}: forward/backward ran for {sorted(done_f[r])}/{sorted(done_b[r])}, "
                                f"expected every (micro-batch, chunk) once")
    span = max(clock)
    return {"busy": busy, "makespan": span, "bubble": [1 - b / span for b in busy], "peak_live": peak,
            "events": events}


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of GPipe / 1F1B, (p−1)/(m+p−1); interleaving divides the fill time by v."""
    return (p - 1) / (v * m + p - 1)


def legalize_for_nccl(programs: list[list[Op]], micro_batches: int, virtual_stages: int = 1,
                      max_moves: int = 100_000) -> list[list[Op]]:
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
