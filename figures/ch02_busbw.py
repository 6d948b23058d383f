"""Chapter 02's bandwidth picture: busbw against message size, ours (the default, checked path
and every row the bench prints) against the backend's built-in, with the min–max band of the
repetitions, the α-β model's prediction for `auto` dashed and auto's switch points marked.

    python -m figures.ch02_busbw                  # runs primitives/engine/bench.py at N = 2 and 4 (~3 min)
    python -m figures.ch02_busbw --json a.json b.json

The numbers are bench.py's own (`torchrun ... primitives/engine/bench.py --fit --json`); this module
only draws them, and the α-β parameters it dashes are the ones that run fitted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from figures.common import ROOT, pyplot, save
from primitives.engine.cost import Params, predict
from primitives.engine.launch import free_port

OPS = ("all_reduce", "all_gather_single")


def run_bench(n: int, out: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={n}", f"--master_port={free_port()}",
           "primitives/engine/bench.py", "--ops", ",".join(OPS), "--fit", "--json", out]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return out


def draw(paths: list[str]) -> str:
    results = []
    for p in paths:
        with open(p) as f:
            results.append(json.load(f))
    plt = pyplot()
    fig, axes = plt.subplots(len(OPS), len(results), figsize=(5.2 * len(results), 3.6 * len(OPS)), squeeze=False)
    for j, res in enumerate(results):
        n = res["world_size"]
        fit = res.get("fit")
        params = Params(fit["alpha"], fit["beta"], fit["gamma"]) if fit else None
        for i, op in enumerate(OPS):
            ax = axes[i][j]
            rows = [r for r in res["rows"] if r["op"] == op]
            for impl in dict.fromkeys(r["impl"] for r in rows):
                rr = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["size"])
                xs = [r["size"] for r in rr]
                factor = [r["busbw"] * r["median_s"] for r in rr]          # busbw·t is constant per size
                style = dict(color="0.3", marker="s") if impl == "built-in" else dict(marker="o")
                line, = ax.plot(xs, [r["busbw"] for r in rr], label=impl, ms=3, **style)
                ax.fill_between(xs, [f / r["max_s"] for f, r in zip(factor, rr)],
                                [f / r["min_s"] for f, r in zip(factor, rr)], color=line.get_color(), alpha=0.15)
                if impl == "auto" and params is not None:
                    pred = [f / predict(op, r["chosen"], n, r["size"], params) for f, r in zip(factor, rr)]
                    ax.plot(xs, pred, ls="--", color=line.get_color(), lw=1, label="auto, α-β prediction")
                    prev = None
                    for r in rr:
                        if r["chosen"] != prev:
                            ax.annotate(r["chosen"], (r["size"], r["busbw"]), fontsize=6, rotation=30,
                                        xytext=(2, 6), textcoords="offset points")
                            prev = r["chosen"]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, N = {n}, {res['backend']}", fontsize=9)
            ax.set_xlabel("message size S (bytes)")
            ax.set_ylabel("busbw GB/s")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6)
    fig.suptitle("Bus bandwidth vs size: ours vs the built-in (bands: min–max of the repetitions)")
    return save(fig, "02_busbw", "figures.ch02_busbw", note="numbers from primitives/engine/bench.py --fit --json (one run per N)")


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", nargs="*", help="bench.py --json outputs to draw instead of running the bench")
    a = ap.parse_args(argv if argv is not None else [])
    if a.json:
        return [draw(a.json)]
    with tempfile.TemporaryDirectory() as tmp:
        return [draw([run_bench(n, os.path.join(tmp, f"bench{n}.json")) for n in (2, 4)])]


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
