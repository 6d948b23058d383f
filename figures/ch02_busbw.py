"""Chapter 02's bandwidth picture: all-reduce busbw against size, measured (markers) and the
fitted α-β prediction (lines, same colour) for every algorithm, per transport and N, with the
fit's error stated in each panel; the default path, gloo's and MPICH's built-ins and a memcpy of
the same bytes drawn on the shm panels for scale.

    python -m figures.ch02_busbw                        # runs python -m benchmarks.one_host (~5–10 min)
    python -m figures.ch02_busbw --json one_host.json   # draws a saved run (one_host.py --json)

The numbers are benchmarks/one_host.py's own; the constants drawn are the ones cost_fit.py fits
to those numbers (the same fit one_host.py prints), so the picture shows how well they fit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from figures.common import ROOT, pyplot, save
from primitives.engine.cost import family, predict
from benchmarks.cost_fit import fit_table

REFS = {"default": dict(color="black", lw=2, marker="*"), "gloo": dict(color="0.45", marker="s", ls=":", lw=1),
        "mpich": dict(color="0.65", marker="^", ls=":", lw=1), "memcpy": dict(color="tab:brown", ls="-.", marker="", lw=1)}


def run_bench(out: str) -> str:
    cmd = [sys.executable, "-m", "benchmarks.one_host", "--json", out]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
    return out


def busbw(n, S, t):
    return S / t * 2 * (n - 1) / n / 1e9


def draw(path: str) -> str:
    with open(path) as f:
        res = json.load(f)
    for r in res["rows"]:
        r["med"] = statistics.median(r["samples"])
    table = fit_table([(r["transport"], r.get("op", "all_reduce"), r["algo"], r["n"], r["size"], r["med"])
                       for r in res["rows"] if r["transport"]])        # all-gathers too: they tell β from γ
    rows = [r for r in res["rows"] if r.get("op", "all_reduce") == "all_reduce"]
    ns = sorted({r["n"] for r in rows})
    plt = pyplot()
    fig, axes = plt.subplots(2, len(ns), figsize=(6.2 * len(ns), 8.4), squeeze=False)
    for j, n in enumerate(ns):
        for i, tp in enumerate(("shm", "tcp")):
            ax, errs = axes[i][j], []
            mine = [r for r in rows if r["n"] == n and r["transport"] == tp]
            for k, algo in enumerate(sorted({r["algo"] for r in mine})):
                rr = sorted((r for r in mine if r["algo"] == algo), key=lambda r: r["size"])
                xs = [r["size"] for r in rr]
                p = table[family(algo, tp)][n]
                pred = [predict("all_reduce", algo, n, S, p) for S in xs]
                errs += [r["med"] / q - 1 for r, q in zip(rr, pred)]
                color = f"C{k}"
                ax.plot(xs, [busbw(n, S, r["med"]) for S, r in zip(xs, rr)], ls="", marker="o", ms=4, color=color,
                        label=algo)
                fine = [xs[0] << i for i in range((xs[-1] // xs[0]).bit_length())]      # the model between the points
                ax.plot(fine, [busbw(n, S, predict("all_reduce", algo, n, S, p)) for S in fine], color=color, lw=1)
            if tp == "shm":
                for name, style in REFS.items():
                    rr = sorted((r for r in rows if r["n"] == n and r["name"] == name), key=lambda r: r["size"])
                    if rr:
                        f = (lambda S, t: S / t / 1e9) if name == "memcpy" else (lambda S, t: busbw(n, S, t))
                        ax.plot([r["size"] for r in rr], [f(r["size"], r["med"]) for r in rr], ms=5,
                                label=name + (" (copy GB/s)" if name == "memcpy" else ""), **style)
            worst = max(errs, key=abs)
            ax.set_title(f"all_reduce, N = {n}, our algorithms on {tp}\nfit: median |busbw error| "
                         f"{statistics.median(map(abs, errs)) * 100:.0f} %, worst {worst * 100:+.0f} %", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size S (bytes)")
            ax.set_ylabel("busbw GB/s")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle("busbw vs size: measured (markers) and the α-β model fitted to them (lines)")
    info = res["info"]
    note = (f"benchmarks/one_host.py, median of {len(rows[0]['samples'])} interleaved reps; load {info['load']:.1f} "
            f"at the start; {info['mpich'] or 'no MPICH'}")
    return save(fig, "02_busbw", "figures.ch02_busbw", note=note)


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="a benchmarks/one_host.py --json output to draw instead of running it")
    a = ap.parse_args(argv if argv is not None else [])
    if a.json:
        return [draw(a.json)]
    with tempfile.TemporaryDirectory() as tmp:
        return [draw(run_bench(os.path.join(tmp, "one_host.json")))]


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
