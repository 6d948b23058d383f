"""The schedule simulator: runs every stage's instruction list on a logical clock, no processes.

    python -m pipeline_parallel.engine.simulator        # every schedule's simulated bubble, p = 4, m = 8

Checks what the textbook schedules promise: every dependency (a forward before its activation
arrived, a backward before its gradient), every (micro-batch, chunk) forward and backward once, no
deadlock; reports per-rank busy time, the bubble and the peak stored activations (compute takes
t_fwd / t_bwd, messages are free). Two deadlock models: "buffered" (sends never block: the executor
over gloo) and "nccl" (torch's nccl group runs ungrouped point-to-point ops towards one peer in
posting order, so the k-th op a rank posts towards a peer must pair with the peer's k-th op towards
it; in 1F1B's steady state stage s posts send→s+1, recv←s+1 while s+1 posts send→s, recv←s, and
both sends wait). `legalize_for_nccl` moves one side's receive in front of its send until the nccl
model passes; the engine runs `programs(..., backend="nccl")` on nccl and in strict mode. Posting
both as one group (Communicator.exchange, dist.batch_isend_irecv) is the other cure. Naive, GPipe
and 1F1B keep the formula's bubble; interleaved pays a little (p = 2, m = 4, v = 2: 0.14 for 0.11).
Cost: O(total instructions) per run; a few runs per move, once per engine.
"""
from __future__ import annotations

from rich.table import Table

from pipeline_parallel.schedules import SCHEDULES, bubble_formula, build
from pipeline_parallel.schedules.instructions import SENDS, Instruction, ScheduleError, peer
from primitives.log import console

COMPUTE = ("fwd", "bwd")


def _msg(op, stage: int, p: int):
    """(kind, mb, virtual boundary) — the same key on the sending and the receiving rank."""
    g = op.chunk * p + stage
    if op.kind in ("send_act", "recv_act"):
        return ("act", op.mb, g if op.kind == "send_act" else g - 1)
    return ("grad", op.mb, g - 1 if op.kind == "send_grad" else g)


def simulate(programs: list[list[Instruction]], micro_batches: int, virtual_stages: int = 1, *,
             t_fwd: float = 1.0, t_bwd: float = 2.0, mode: str = "buffered") -> dict:
    """Run one program per rank on a logical clock (compute takes t_fwd / t_bwd, messages are
    free). mode "buffered": sends never block (gloo); "nccl": the k-th op a rank posts towards a peer
    must pair with the peer's k-th op towards it (a send with the matching receive).
    Checks every dependency and that each (micro-batch, chunk) runs forward and backward once
    (forward only, for lists without backward: eval_batch's).
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
    backward = any(op.kind == "bwd" for ops in programs for op in ops)    # eval lists: forwards only
    for r in range(p):
        want = {(mb, c) for mb in range(m) for c in range(v)}
        if done_f[r] != want or done_b[r] != (want if backward else set()):
            raise ScheduleError(f"stage {r}: forward/backward ran for {sorted(done_f[r])}/{sorted(done_b[r])}, "
                                f"expected every (micro-batch, chunk) once")
    span = max(clock)
    return {"busy": busy, "makespan": span, "bubble": [1 - b / span for b in busy], "peak_live": peak,
            "events": events}


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


def table(p: int = 4, m: int = 8):
    """Every schedule through the simulator: bubble next to the formula, peak stored activations."""
    t = Table(title=f"simulated schedules, p = {p} stages, m = {m} micro-batches, t_bwd = 2·t_fwd")
    for col in ("schedule", "v", "bubble (sim)", "formula", "peak stored activations per stage (in chunks)"):
        t.add_column(col)
    for name in SCHEDULES:
        v = 2 if name == "interleaved" else 1
        r = simulate([build(name, s, p, m, v) for s in range(p)], m, v)
        f = {"naive": (p - 1) / p}.get(name, bubble_formula(p, m, v))
        t.add_row(name, str(v), f"{max(r['bubble']):.3f}", f"{f:.3f}", str(r["peak_live"]))
    return t


if __name__ == "__main__":
    console.print(table())
