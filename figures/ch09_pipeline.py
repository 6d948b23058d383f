"""Chapter 09's pictures: the measured timeline of every pipeline schedule, one PNG each, and
the measured bubble per stage next to the formula (p−1)/(v·m+p−1).

    python -m figures.ch09_pipeline                              # p = 4, m = 8, every schedule
    python -m figures.ch09_pipeline --pp 2 --micro-batches 4 --schedules gpipe 1f1b

The timestamps come from pipeline_parallel.engine.timeline (every instruction of the last step timed on
every rank, one monotonic clock for all local processes); this module only draws them.
"""
from __future__ import annotations

import argparse
import os
import sys

from rich.table import Table

from figures.common import ROOT, pyplot, save
from pipeline_parallel.engine.timeline import COLORS, _run, machine, measure
from pipeline_parallel.schedules import bubble_formula
from primitives.launch import spawn
from primitives.log import console


def draw(events_per_rank, title, name, labels=None, source="figures.ch09_pipeline"):
    """One row per rank (labels: its y-axis names, default "stage r"); saved as tutorials/img/<name>.png."""
    plt = pyplot()
    bubbles, span, t0 = measure(events_per_rank)
    p = len(events_per_rank)
    fig, ax = plt.subplots(figsize=(12, 0.7 * p + 1.6))
    for r, ev in enumerate(events_per_rank):
        for kind, mb, chunk, a, b in ev:
            if b - a <= 0:
                continue
            ax.broken_barh([((a - t0) * 1e3, (b - a) * 1e3)], (p - 1 - r - 0.4, 0.8), color=COLORS.get(kind, "#999"),
                           edgecolor="white", linewidth=0.3)
            if kind in ("fwd", "bwd") and (b - a) / span > 0.02:
                ax.text((a + b - 2 * t0) / 2 * 1e3, p - 1 - r, f"{mb}" + (f".{chunk}" if chunk else ""),
                        ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p))
    labels = labels or [f"stage {r}" for r in range(p)]
    ax.set_yticklabels([f"{labels[r]}\nbubble {bubbles[r]:.0%}" for r in range(p)][::-1], fontsize=8)
    ax.set_xlabel("ms since the step began")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("fwd", "bwd", "recv_act", "send_act", "reduce_grads", "step")]
    ax.legend(handles, ["forward", "backward", "waiting for a receive", "posting a send", "tied/dp reduce", "optimizer step"],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 3 else -0.18), ncol=6, fontsize=7, frameon=False)
    return bubbles, save(fig, name, source, note="every instruction of the last step timed on every rank")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=2, help="for the interleaved schedule")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="the last one is drawn")
    ap.add_argument("--schedules", nargs="+", default=["naive", "gpipe", "1f1b", "interleaved"])
    a = ap.parse_args(argv if argv is not None else [])
    paths = []
    p, m = a.pp, a.micro_batches
    t = Table(title=f"measured bubble, p = {p}, m = {m} ({machine()})")
    for col in ("schedule", "v", "step ms", "bubble per stage (measured)", "max", "formula", "picture"):
        t.add_column(col)
    for s in a.schedules:
        v = a.virtual_stages if s == "interleaved" else 1
        events = spawn(_run, p, args=(s, v, m, a.dim, a.rows, a.steps), timeout=600)
        f = (p - 1) / p if s == "naive" else bubble_formula(p, m, v)
        bubbles, path = draw(events, f"{s} (v={v}), p={p} stages, m={m} micro-batches — formula bubble {f:.0%}",
                             f"09_timeline_{s}")
        paths.append(path)
        span = measure(events)[1]
        t.add_row(s, str(v), f"{span * 1e3:.0f}", " ".join(f"{b:.2f}" for b in bubbles), f"{max(bubbles):.2f}",
                  f"{f:.2f}", os.path.relpath(path, ROOT))
    console.print(t)
    return paths


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
