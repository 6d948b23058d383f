"""The slack's rule across shapes and engines: the allocator's slack of the DDP step and of the
pipeline's stages at shapes beside the rows', measured over fresh launches, against
planner.host_memory.allocator_slack.

    python -m benchmarks.planner_slack_across                 # every case, 6 launches each (~20 min idle)
    python -m benchmarks.planner_slack_across --only zero1    # one engine's cases
    python -m benchmarks.planner_slack_across --launches 3 --only pipe

Cases (L 4, h 256 as gpt-mini, seq 128; the vocabulary and micro-batches move the largest block a
step frees, S = planner.host_memory.largest_freed): the DDP step (benchmarks.planner_ranks._rank,
2 ranks, mb 4 or 2) at vocabularies 4,096 and 16,000, the same through zero_from_scratch's ZeRO-1
and ZeRO-2 engine, and the pipeline (planner_ranks._pp_rank,
pp 2, mb 2) at 4,096 and 16,000 with 4 micro-batches and at gpt-mini's 8,192 with 2, 4 and 8. Each
launch is a fresh interpreter as Python starts by default (benchmarks.planner_slack_seeds.launch:
its own draw of the heap), 4 steps; its slack is the larger rank's peak less the planner's count
of its heavier stage without slack. Printed: each case's median and range, the median in bytes
per byte of S, and the planner's slack term. The DDP rule adds twice S to a constant; the ZeRO
engine's is proportional to S, as the pipeline's at the fit's 4 micro-batches (the m 2 and m 8
cases test its square root).
Cost: --launches × 11 launches of 4 steps.
"""
from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.planner_ranks import _pp_rank, _rank
from benchmarks.planner_slack_seeds import CHILD_ZERO, launch
from planner.hardware import cpu_here
from planner.host_memory import largest_freed, stage_kinds
from planner.layout import Layout
from planner.memory import memory
from planner.model import Model
from primitives.launch import spawn
from primitives.log import console
from rich.table import Table

MiB = 2**20
CASES = [("ddp", 4096, 4, 1), ("ddp", 16000, 2, 1), ("zero1", 4096, 4, 1), ("zero1", 16000, 2, 1),
         ("zero2", 4096, 4, 1), ("zero2", 16000, 2, 1), ("pipe", 4096, 2, 4), ("pipe", 16000, 2, 4),
         ("pipe", 8192, 2, 2), ("pipe", 8192, 2, 4), ("pipe", 8192, 2, 8)]      # (engine, vocabulary, mb, micro-batches)
CHILD = {"ddp": "ranks", "zero1": "zero1", "zero2": "zero2", "pipe": "pipe"}     # a case's launched child
ZERO = {e: CHILD_ZERO[c] or 0 for e, c in CHILD.items() if c in CHILD_ZERO}      # its ZeRO stage (planner_slack_seeds')


def shape(vocab: int) -> Model:
    return Model(f"gpt-mini-v{vocab}", 4, 256, 4, vocab, 128, positions=128)


def planned(engine: str, vocab: int, mb: int, micro: int) -> tuple[float, float, float]:
    """(the planner's count without slack, its slack term, S) of the case's heavier stage."""
    m = shape(vocab)
    lay = Layout(2, 1, 1, zero=ZERO[engine], mb=mb) if engine in ZERO else Layout(1, 1, 2, mb=mb)
    batch = 2 * mb if engine in ZERO else mb * micro
    hw = cpu_here(2)
    full = memory(m, m.seq, lay, batch, hw)
    count = full["total"] - full["reserved"] - full["allocator"]
    return count, full["allocator"], largest_freed(m, lay, m.seq, stage_kinds(lay, full["stage"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=6, help="fresh interpreters per case (default 6)")
    ap.add_argument("--only", choices=tuple(CHILD), help="one engine's cases")
    ap.add_argument("--child", choices=tuple(CHILD.values()), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.child and (a.steps is not None or a.case):
        ap.error("--steps and --case are a launched child's (each launch runs 4 steps); expected --launches / --only")
    if a.child:
        if not a.case or len(a.case.split(",")) != 3:
            ap.error(f"--child {a.child}: expected --case VOCAB,MB,MICRO")
        if a.steps is not None and a.steps < 2:
            ap.error(f"--steps {a.steps}: expected at least 2 (the first step is not timed)")
        vocab, mb, micro = map(int, a.case.split(","))
        m = shape(vocab)
        steps = a.steps or 4
        got = (spawn(_rank, 2, args=(m, mb, steps, CHILD_ZERO[a.child]), timeout=900) if a.child in CHILD_ZERO
               else spawn(_pp_rank, 2, args=(m, mb, micro, steps), timeout=900))
        print(json.dumps({"peak": max(g["peak"] for g in got)}))
        return 0
    if a.launches < 1:
        ap.error(f"--launches {a.launches}: expected a positive count")
    t = Table(title=f"the allocator's slack over {a.launches} launches a case, L 4, h 256, 4 steps (MiB)")
    for col in ("engine", "V", "mb", "micro-batches", "S", "count", "slack median", "range", "per byte of S", "planner", "error"):
        t.add_column(col, justify="right")
    for engine, vocab, mb, micro in CASES:
        if a.only and engine != a.only:
            continue
        count, term, big = planned(engine, vocab, mb, micro)
        got = [launch("", 4, CHILD[engine], None, module="benchmarks.planner_slack_across",
                      extra=("--case", f"{vocab},{mb},{micro}")) - count for _ in range(a.launches)]
        med = statistics.median(got)
        t.add_row(engine, f"{vocab:,}", str(mb), str(micro), f"{big / MiB:.1f}", f"{count / MiB:.1f}", f"{med / MiB:.1f}",
                  f"{min(got) / MiB:.1f}-{max(got) / MiB:.1f}", f"{med / big:.2f}" if big else "", f"{term / MiB:.1f}",
                  f"{(term - med) / MiB:+.1f}")
    console.print(t)
    console.print("error: the planner's slack less the measured median (MiB); the planner's slack term is "
                  "planner.host_memory.allocator_slack at this processor's fit", highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
