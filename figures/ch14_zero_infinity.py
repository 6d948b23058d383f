"""Chapter 14's memory picture: peak RSS per rank of a T5-shaped model under ZeRO-1, ZeRO-3,
ZeRO-Offload and ZeRO-Infinity, built plainly or under zero.Init, against the fp32 weights (4Ψ)
and a quarter of them. Measured by benchmarks/zero_memory_table.py (2 spawned gloo ranks, fp32).

    python -m figures ch14_zero_infinity                         # the T5 of the table (d_model 384), ~10 min
    python -m figures.ch14_zero_infinity --quick                 # d_model 128: proves it runs (~2 min)
    python -m figures.ch14_zero_infinity --json table.json       # draw a saved `zero_memory_table.py --json` run

One pair of bars per configuration (the worse rank): the peak while building the model and running
initialize, and the peak of the training steps; both above the RSS just before the model is built.
The label over each pair is the seconds per step (median after the first, 2 shared cores).
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.zero_memory_table import MIB, measure, states
from figures.common import pyplot, save

SHORT = {"ZeRO-1": "ZeRO-1", "ZeRO-3": "ZeRO-3", "ZeRO-3 + offload_optimizer": "+ offload\noptimizer",
         "ZeRO-3 + offload_param + offload_optimizer": "Infinity\n(param + optim)",
         "ZeRO-3 + offload_optimizer, zero.Init": "Init +\noffload optim",
         "ZeRO-3 + offload_param + offload_optimizer, zero.Init": "Init +\nInfinity",
         "ZeRO-3 + offload_param + offload_optimizer, zero.Init, activation checkpointing": "Init + Infinity\n+ act. ckpt"}


def draw(data: dict, name: str = "14_zero_infinity") -> str:
    plt = pyplot()
    psi, res, size = data["psi"], data["rows"], data["size"]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for x, (run, r) in enumerate(res.items()):
        built, train = max(v["built"] for v in r) / MIB, max(v["train"] for v in r) / MIB
        ax.bar(x - 0.19, built, width=0.38, color="#8172B2" if "Init" in run else "#4C72B0")
        ax.bar(x + 0.19, train, width=0.38, color="#55A868")
        ax.plot([x - 0.4, x + 0.4], [states(run, psi) / MIB] * 2, color="0.2", lw=1.5, ls=":")
        ax.text(x, max(built, train), f"{r[0]['step_s']:.1f} s/step", ha="center", va="bottom", fontsize=8)
    ax.axhline(4 * psi / MIB, color="#C44E52", lw=1.2)
    ax.axhline(psi / MIB, color="#C44E52", lw=1.2, ls="--")
    ax.set_xticks(range(len(res)), [SHORT.get(k, k) for k in res], fontsize=8)
    ax.set_ylabel("peak RSS per rank above the pre-model RSS, MiB")
    legend = {"build + initialize (plain)": "#4C72B0", "build + initialize (zero.Init)": "#8172B2",
              "training steps": "#55A868"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in legend.values()]
    handles += [plt.Line2D([], [], color="0.2", ls=":"), plt.Line2D([], [], color="#C44E52"),
                plt.Line2D([], [], color="#C44E52", ls="--")]
    ax.legend(handles, [*legend, "model states left in memory (formula)", "fp32 weights, 4Ψ",
                        "budget ¼ × 4Ψ"], fontsize=7, loc="upper right")
    ax.set_title(f"T5 (d_model {size['d']}, {size['layers']}+{size['layers']} layers), Ψ = {psi:,}, N = 2, fp32, "
                 "offload to files (nvme): the worse rank of each run", fontsize=10, loc="left")
    return save(fig, name, "figures.ch14_zero_infinity", note="VmHWM at allocator defaults (the engine's own announced setting included); "
                f"each bar a fresh pair of ranks (benchmarks/zero_memory_table.py); {data['machine']}")


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="draw this benchmarks/zero_memory_table.py --json output instead")
    a = ap.parse_args(argv if argv is not None else [])
    if a.json:
        with open(a.json) as f:
            data = json.load(f)
    else:
        data = measure(a.quick, a.steps)
    return [draw(data)]


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
