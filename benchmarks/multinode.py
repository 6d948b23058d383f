"""Flat ring vs hierarchical vs gloo's built-in across two namespaced nodes on a shaped link,
and bucketed (overlapped) vs flat data parallelism on the slow link. Needs root.

    python -m benchmarks.multinode                         # 400 and 100 Mbit/s, writes tutorials/img/11_multinode_busbw.png
    python -m benchmarks.multinode --rates 100 --sizes 1,4,8 --reps 3 --parts collectives,zero

For each rate: `multinode up` a fresh 2-node cluster, run benchmarks/multinode_worker.py (as a module) under torchrun
on 2 nodes × 2 ranks, then `down`. The worker
  1. fits α, β per link class with a gloo ping-pong (rank 0 ↔ 1 on one node, rank 0 ↔ 2 across),
  2. times all-reduce of S bytes (S = --sizes MiB) with algorithm="ring" (flat), "hierarchical"
     and torch.distributed.all_reduce (gloo's built-in, which does not know the topology),
     interleaved call by call, a barrier before each, medians over --reps; busbw = S/t·2(N-1)/N,
  3. and the same for all-gather and reduce-scatter at the largest size.
The model (primitives.engine.cost.predict_2level with the fitted links) is printed next to each
measurement and dashed in the figure. Then benchmarks/ddp_overlap.py runs across the nodes
at the slowest rate: chapter 3 (flat, one all-reduce after backward) vs chapter 4 (buckets
all-reduced during backward), and ZeRO-3 vs ZeRO-3 + hpZ (zero_hpz_partition_size = ranks per
node): step time and the inter-node bytes the ledger counted. Figures are from a shared 2-core
machine: ratios, not absolutes.
"""
from __future__ import annotations

import os
import sys

if not __package__:   # run by path: this folder (and its multinode.py) would hide the multinode package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import json
import statistics
import tempfile

from rich.console import Console
from rich.table import Table

from benchmarks.multinode_worker import ALGOS, MIB
from figures import common
from multinode import cluster as C
from multinode.run import run
from primitives.engine.cost import Links, Params, predict_2level

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# as a module: run by path, this folder would come first on sys.path and its multinode.py hide the package
WORKER = "-m benchmarks.multinode_worker"


def _links(res):
    g = res["gamma"]
    return Links(intra=Params(res["intra"]["alpha_s"], res["intra"]["beta_s_per_byte"], g),
                 inter=Params(res["inter"]["alpha_s"], res["inter"]["beta_s_per_byte"], g))


def _env():
    e = dict(os.environ)
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    return e


def on_cluster(rate, cmd, timeout):
    name = f"rzb{os.getpid() % 100000}"
    old_env, old_cwd = dict(os.environ), os.getcwd()
    try:
        c = C.up(2, rate, name)
        os.environ.update(_env())
        os.chdir(ROOT)
        code, err = run(c, cmd, timeout=timeout, port=29555, out=open(os.devnull, "w") if not VERBOSE else None)
        if code:
            raise SystemExit(f"benchmark run on {rate} Mbit/s failed: {err}")
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        C.down(name)


VERBOSE = False
TORCHRUN = ("torchrun --nnodes 2 --nproc_per_node 2 --node_rank $NODE_RANK --master_addr $MASTER_ADDR "
            "--master_port $MASTER_PORT ")


def main() -> None:
    global VERBOSE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="400,100", help="Mbit/s per node, comma-separated")
    ap.add_argument("--sizes", default="0.25,1,4,8", help="all-reduce sizes in MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-ddp", action="store_true", help="skip the bucketed-vs-flat DDP comparison")
    ap.add_argument("--png", default=os.path.join(ROOT, "tutorials", "img", "11_multinode_busbw.png"))
    ap.add_argument("--json", default=None, help="also write every figure here")
    ap.add_argument("--verbose", action="store_true", help="stream the nodes' output")
    ap.add_argument("--parts", default="collectives,ddp,zero", help="which parts to run")
    args = ap.parse_args()
    args.sizes = [float(s) for s in args.sizes.split(",")]
    parts = set(args.parts.split(","))
    VERBOSE = args.verbose
    con = Console()
    rates = [float(x) for x in args.rates.split(",")]
    results = {}
    for rate in (rates if "collectives" in parts else []):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "res.json")
            on_cluster(rate, TORCHRUN + f"{WORKER} --worker {out} --reps {args.reps} "
                       f"--sizes {','.join(map(str, args.sizes))}", timeout=1200)
            with open(out) as f:
                results[rate] = json.load(f)
    for rate, res in results.items():
        links, n, m, k = _links(res), res["world"], res["nodes"], res["local"]
        con.print(f"[bold]{rate:g} Mbit/s[/]: fitted intra α={links.intra.alpha * 1e6:.0f} µs, "
                  f"{8 / links.intra.beta / 1e6:.0f} Mbit/s; inter α={links.inter.alpha * 1e6:.0f} µs, "
                  f"{8 / links.inter.beta / 1e6:.0f} Mbit/s; γ={res['gamma'] * 1e9:.2f} ns/B (gloo ping-pong)")
        t = Table(title=f"{m} nodes × {k} ranks, {rate:g} Mbit/s per node: busbw MB/s, median of {args.reps} "
                        "(model in brackets)")
        for col in ("collective", "size", "ring (flat)", "hierarchical", "gloo built-in", "hier / built-in",
                    "hier / ring"):
            t.add_column(col, justify="right")
        res["rows"] = []
        for key in sorted({k_.rsplit("|", 1)[0] for k_ in res["times"]}, key=lambda s: (s.split("|")[0], int(s.split("|")[1]))):
            nm, s = key.split("|")
            s = int(s)
            factor = 2 * (n - 1) / n if nm == "all_reduce" else (n - 1) / n
            med = {a: statistics.median(res["times"][f"{key}|{a}"]) for a in ALGOS}
            bw = {a: s / med[a] * factor / 1e6 for a in ALGOS}
            model = {a: s / predict_2level(nm, "ring" if a == "built-in" else a, m, k, s, links) * factor / 1e6
                     for a in ("ring", "hierarchical")}
            res["rows"].append({"name": nm, "bytes": s, "busbw": bw, "model": model})
            t.add_row(nm, f"{s / MIB:g} MiB", f"{bw['ring']:.1f} [{model['ring']:.1f}]",
                      f"{bw['hierarchical']:.1f} [{model['hierarchical']:.1f}]", f"{bw['built-in']:.1f}",
                      f"{bw['hierarchical'] / bw['built-in']:.2f}×", f"{bw['hierarchical'] / bw['ring']:.2f}×")
        con.print(t)
    if results:
        _figure(results, args.png)
        con.print(f"figure: {args.png}")
    if "ddp" in parts and not args.no_ddp:
        slow = min(rates)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ddp.json")
            on_cluster(slow, TORCHRUN + f"benchmarks/ddp_overlap.py --hidden 512 --depth 4 --batch 512 "
                       f"--steps 6 --warmup 2 --bucket-cap-mb 1 --json {out}", timeout=1200)
            with open(out) as f:
                ddp = json.load(f)
        results["ddp"] = ddp
        med = ddp.get("median_s", ddp)
        con.print(f"DDP on {slow:g} Mbit/s, 2 nodes × 2 ranks: flat (chapter 3) / bucketed (chapter 4) step time = "
                  f"[bold]{ddp['ratio_flat_over_bucketed']:.2f}×[/]; bucketed / torch DDP = "
                  f"{ddp['ratio_bucketed_over_ddp']:.2f}×  ({json.dumps(med)[:200]})")
    if "zero" in parts:
        slow = min(rates)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "zero.json")
            on_cluster(slow, TORCHRUN + f"{WORKER} --zero-worker {out} --reps {args.reps}",
                       timeout=1200)
            with open(out) as f:
                z = json.load(f)
        results["zero"] = z
        med = {n: statistics.median(v) for n, v in z["times"].items()}
        t = Table(title=f"ZeRO-3 on {slow:g} Mbit/s, 2 nodes × {z['k']} ranks, Ψ = {z['params']:,}: per step, "
                        f"median of {args.reps}")
        for col in ("engine", "step s (min–max)", "inter-node bytes a node sends (ledger)", "vs ZeRO-3"):
            t.add_column(col, justify="right")
        for n, v in z["times"].items():
            t.add_row(n, f"{med[n]:.2f} ({min(v):.2f}–{max(v):.2f})", f"{z['inter_bytes_per_node'][n]:,.0f}",
                      f"{med[n] / med['zero3']:.2f}× time, "
                      f"{z['inter_bytes_per_node'][n] / z['inter_bytes_per_node']['zero3']:.2f}× bytes")
        con.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k_): v for k_, v in results.items()}, f, indent=1)


def _figure(results, path):
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    colors = {"ring": "tab:blue", "hierarchical": "tab:red", "built-in": "tab:gray"}
    for ax, (rate, res) in zip(axes[0], results.items()):
        rows = [r for r in res["rows"] if r["name"] == "all_reduce"]
        xs = [r["bytes"] / MIB for r in rows]
        for a in ALGOS:
            ax.plot(xs, [r["busbw"][a] for r in rows], "o-", color=colors[a],
                    label={"ring": "flat ring", "built-in": "gloo built-in"}.get(a, a))
        for a in ("ring", "hierarchical"):
            ax.plot(xs, [r["model"][a] for r in rows], "--", color=colors[a], alpha=0.7, label=f"model: {a}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("all-reduce size S (MiB)")
        ax.set_ylabel("busbw (MB/s)")
        ax.set_title(f"2 nodes × 2 ranks, {rate:g} Mbit/s link (tbf)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("ringzero: all-reduce across namespaced nodes (gloo)", fontsize=9)
    if os.path.dirname(os.path.abspath(path)) == common.IMG:      # the tutorial's picture: stamped
        common.save(fig, os.path.splitext(os.path.basename(path))[0], "benchmarks.multinode",
                    note="python -m benchmarks.multinode (needs root: it builds the namespaced cluster)")
    else:
        fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
