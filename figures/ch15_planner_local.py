"""Chapter 15's check on this machine: the planner's predicted step time and peak memory per rank
against the measured ones, one point per layout run on 2-4 CPU ranks (benchmarks.planner_local).

    python -m figures.ch15_planner_local                       # measures first (~3 min idle, more under load)
    python -m figures.ch15_planner_local --json local.json     # draw a saved `benchmarks.planner_local --json` run

Left: step time, predicted from cpu_here.json's CPU-time rates, the cores a session got and the
speed of a CPU second the ranks read between their steps (planner.probe.Rate,
benchmarks.planner_rows.in_row_speed); the band is ±25 %. Right: peak resident memory above the
pre-model baseline at glibc's defaults, predicted vs measured, band ±10 %. Each point is labelled
with its row and the load it ran under; a point outside its band is red; each panel's title
gives the median |error|.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks.planner_local import measure
from planner.probe import in_own_session
from figures.common import pyplot, save


def _short(layout: str) -> str:
    for long, short in ((" (torch)", ""), (" (engine)", ""), (" 1F1B m4 mb2", ""), (" mb4", ""), ("(malloc 64K)", "malloc 64K"),
                        (" (parallelize, HF DistilBERT)", ""), (" (engine, HF llama)", "")):
        layout = layout.replace(long, short)
    return layout


def draw(rows: list[dict]) -> str:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.4))
    for ax, key, scale, unit, band in ((a, "step", 1e3, "ms", 0.25), (b, "mem", 2**-20, "MiB", 0.10)):
        meas = [r[f"{key}_meas"] * scale for r in rows]
        pred = [r[f"{key}_pred"] * scale for r in rows]
        miss = [abs(y / x - 1) > band for x, y in zip(meas, pred)]
        ax.scatter(meas, pred, zorder=3, label="predicted", c=["tab:red" if e else "tab:blue" for e in miss])
        for r, x, y in zip(rows, meas, pred):
            ax.annotate(f"{r['model'].replace('gpt-', '')} {_short(r['layout'])} (load {r['load']:.0f})", (x, y),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        med = statistics.median(abs(y / x - 1) for x, y in zip(meas, pred))
        lo, hi = 0.0, max(meas + pred) * 1.15
        if key == "step":      # the load swings a step over two orders of magnitude: log axes
            lo = min(meas + pred) / 1.5
            ax.set(xscale="log", yscale="log")
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)], color="0.9",
                        label=f"±{band:.0%}")
        ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel=f"measured {unit}", ylabel=f"predicted {unit}")
        ax.legend(fontsize=7, loc="upper left")
        ax.set_title(("step time (CPU ranks, fp32)" if key == "step" else "peak RSS above the pre-model baseline, per rank")
                     + f"\nmedian |error| {med:.0%}, {sum(miss)} of {len(miss)} outside ±{band:.0%}", fontsize=9)
    shares = [r["share"] for r in rows]
    fig.suptitle(f"planner (cpu-here, probed) vs this machine; each busy task got {min(shares) / 2:.2f}–{max(shares) / 2:.2f} "
                 f"of a core (2 cores)",
                 fontsize=10)
    return save(fig, "15_planner_local", "figures.ch15_planner_local",
                note="python -m benchmarks.planner_local; time under load, memory load-independent")


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="rows written by `python -m benchmarks.planner_local --json FILE`")
    ap.add_argument("--steps", type=int, default=3, help="steps per row when measuring (at least 2)")
    a = ap.parse_args(argv if argv is not None else [])
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: expected at least 2 (each row's median is over the steps after the first)")
    if a.json:
        with open(a.json) as f:
            rows = json.load(f)
    else:     # in a session of its own, as benchmarks.planner_local runs (planner.probe's docstring)
        if (rc := in_own_session("figures.ch15_planner_local", argv)) is not None:
            return [] if rc == 0 else sys.exit(rc)
        rows = measure(False, a.steps)
    return [draw(rows)]


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
