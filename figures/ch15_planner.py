"""Chapter 15's pictures: the planner's step-time terms for one model at three cluster sizes, and
its predictions against the published runs.

    python -m figures.ch15_planner

Numbers come from planner.plan (llama-13b on 8, 64 and 512 A100s, sequence 4096, 4 M tokens per
step, no communication overlapped, so every term shows) and planner.published (Narayanan et al. Table 1, Megatron-LM's H100 weak scaling): no
measurement, ~20 s.
"""
from __future__ import annotations

import argparse

from figures.common import pyplot, save
from planner import hardware as H
from planner import published as pub
from planner.model import PRESETS
from planner.plan import plan
from planner.report import TIME_TERMS
from planner.steptime import Software

SIZES = (8, 64, 512)
BATCH = 1024          # sequences of 4096: 4 M tokens per step


def terms() -> str:
    plt = pyplot()
    m = PRESETS["llama-13b"]
    fig, ax = plt.subplots(figsize=(10, 4))
    labels, rows = [], []
    for n in SIZES:
        best = plan(m, n, H.A100, m.seq, BATCH, Software(False, False, False))[0]   # every cost line exposed
        labels.append(f"{n} GPUs\n{best.layout.label()}")
        rows.append(best)
    left = [0.0] * len(rows)
    for k in TIME_TERMS:
        w = [p.time[k] * n for p, n in zip(rows, SIZES)]            # GPU-seconds per step
        ax.barh(labels, w, left=left, label=k)
        left = [a + b for a, b in zip(left, w)]
    ax.set_xlabel("GPU-seconds per step (step time × GPUs): equal bars = perfect scaling")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("llama-13b, batch 1024 × 4096 tokens, A100s, no overlap (--no-overlap): the best layout per cluster size", fontsize=9)
    return save(fig, "15_planner_terms", "figures.ch15_planner")


def published() -> str:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2))
    nr = pub.narayanan_rows()
    a.scatter([r["reported"] for r in nr], [r["predicted"] for r in nr])
    for r in nr:
        a.annotate(r["model"].replace("gpt-", ""), (r["reported"], r["predicted"]), fontsize=7)
    lo, hi = 110, 190
    a.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    a.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9", label="±15 %")
    a.set(xlabel="reported TFLOP/s per GPU", ylabel="predicted", title="Narayanan et al. Table 1 (A100)")
    a.legend(fontsize=7)
    wk = pub.megatron_weak_rows()
    b.scatter([r["reported_mfu"] for r in wk], [r["predicted_mfu"] for r in wk])
    for r in wk:
        b.annotate(r["model"], (r["reported_mfu"], r["predicted_mfu"]), fontsize=7)
    lo, hi = 35, 55
    b.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    b.fill_between([lo, hi], [lo - 5, hi - 5], [lo + 5, hi + 5], color="0.9", label="±5 points")
    b.set(xlabel="reported MFU %", ylabel="predicted", title="Megatron-LM README, H100 weak scaling")
    b.legend(fontsize=7)
    return save(fig, "15_planner_published", "figures.ch15_planner",
                note="first row of each table calibrates gemm_efficiency; the others are predictions")


def main() -> list[str]:
    return [terms(), published()]


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for p in main():
        print(p)
