"""Chapter 11's ZeRO++ picture: bytes each rank sends per optimizer step, by collective, for
ZeRO-3, qwZ, qgZ and qwZ + qgZ, and the training loss of each against unquantised ZeRO-3.
Measured by benchmarks/zeropp.py (the primitives ledger; 2 spawned gloo ranks, fp32).

    python -m figures.ch14_zeropp                          # the classification model (DistilBERT/MiniLM), minutes
    python -m figures.ch14_zeropp --model mlp              # the MLP, ~20 s
    python -m figures.ch14_zeropp --json zeropp_cls.json   # draw a saved `benchmarks/zeropp.py --json` run

Left: stacked bars, one per run, one segment per collective purpose (the ledger's measured bytes);
the label is the data total as a fraction of ZeRO-3's. Right: loss per step (mean over ranks),
and below it each quantised run's loss minus ZeRO-3's, in % of ZeRO-3's, step by step.
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.zeropp import compare
from figures.common import pyplot, save

COLOURS = {"all-gather (forward": "#4C72B0", "all-gather (backward": "#55A868", "hpZ": "#8172B2",
           "grad": "#C44E52"}

RUN_COLOURS = {"ZeRO-3": "0.25", "qwZ": "#DD8452", "qgZ": "#937860", "qwZ + qgZ": "#DA3B8A", "qwZ + qgZ + hpZ": "#8172B2"}


def _colour(purpose: str) -> str:
    return next((c for k, c in COLOURS.items() if k in purpose), "0.6")


def draw(data: dict, name: str = "14_zeropp") -> str:
    plt = pyplot()
    res, model, world = data["results"], data["model"], data["world"]
    fig = plt.figure(figsize=(11, 5.2))
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 1.3], height_ratios=[1.6, 1])
    bars, curves, delta = fig.add_subplot(grid[:, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, 1])
    base = res["ZeRO-3"]["data_sent"]
    for x, (run, r) in enumerate(res.items()):
        bottom = 0.0
        for purpose, row in r["rows"].items():
            kib = row["sent"] / 2**10
            bars.bar(x, kib, bottom=bottom, color=_colour(purpose), edgecolor="white", width=0.6,
                     hatch="//" if ("int" in purpose or "hpZ" in purpose) else None)
            bottom += kib
        bars.text(x, bottom, f"{r['data_sent'] / base:.2f}×", ha="center", va="bottom", fontsize=8)
    bars.set_xticks(range(len(res)), list(res), fontsize=8)
    bars.set_ylabel("KiB sent per optimizer step, rank 0")
    bars.set_title("bytes by collective (hatched: int8 / int4 on the wire)", fontsize=9, loc="left")
    legend = {"param all-gather, forward": "#4C72B0", "param all-gather, backward": "#55A868",
              "gradient reduce-scatter / all-to-all": "#C44E52"}
    bars.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in legend.values()], list(legend), fontsize=7)
    ref = res["ZeRO-3"]["losses"]
    for run, r in res.items():
        curves.plot(range(1, len(r["losses"]) + 1), r["losses"], label=run, color=RUN_COLOURS.get(run),
                    lw=2.2 if run == "ZeRO-3" else 1.2, ls="-" if run in ("ZeRO-3", "qwZ + qgZ") else ":")
    last = {run: sum(r["losses"][-5:]) / 5 for run, r in res.items()}
    r5 = last["ZeRO-3"]
    curves.set_title("training loss (mean over ranks); last 5 steps vs ZeRO-3: "
                     + ", ".join(f"{k} {100 * (v - r5) / r5:+.1f} %" for k, v in last.items() if k != "ZeRO-3"),
                     fontsize=8, loc="left")
    curves.set_ylabel("loss")
    curves.legend(fontsize=8)
    for run, r in res.items():
        if run != "ZeRO-3":
            delta.plot(range(1, len(ref) + 1), [100 * (a - b) / b for a, b in zip(r["losses"], ref)],
                       color=RUN_COLOURS.get(run),
                       lw=1.5 if run == "qwZ + qgZ" else 1.0, ls="-" if run == "qwZ + qgZ" else ":")
    delta.axhline(0, color="0.5", lw=0.8)
    delta.set_ylabel("Δ loss vs ZeRO-3, %")
    delta.set_xlabel("optimizer step")
    fig.suptitle(f"ZeRO++ qwZ (int8 weights) and qgZ (int4 gradients) vs ZeRO-3: {model}, "
                 f"Ψ = {res['ZeRO-3']['psi']:,}, N = {world}, fp32, {len(ref)} steps", fontsize=10)
    return save(fig, name, "figures.ch14_zeropp", note="bytes: primitives ledger via engine.comm_report; "
                "losses: the same seeds and batches in every run (benchmarks/zeropp.py)")


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("classification", "mlp"), default="classification")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None, help="draw this benchmarks/zeropp.py --json output instead of running")
    a = ap.parse_args(argv if argv is not None else [])
    if a.json:
        with open(a.json) as f:
            data = json.load(f)
    else:
        data = {"model": a.model, "world": 2, "results": compare(a.model, a.steps)}
    return [draw(data)]


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
