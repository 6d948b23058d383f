"""Fit the planner's `cpu-here` hardware file on this machine: a matmul sweep for the compute
rate, a large add for the memory rate; links come from benchmarks.one_host's α-β fit
(primitives.engine.cost.FITTED), read by planner.hardware.cpu_here.

    python -m benchmarks.planner_fit                 # writes planner/cpu_here.json (~20 s)
    python -m benchmarks.planner_fit --out /tmp/cpu.json --quick

Measured as training runs: `--ranks` processes (default 2) at once, one thread each, fp32, and
the median of the repetitions (not the best), so the rates are what a rank gets while the others
compute and whatever else shares the cores. host_adam: torch's AdamW on 4 M parameters (on
cpu-here the optimizer runs on the host, planner.steptime). peak_flops is the best median rate of the sweep;
gemm_efficiency the transformer-shaped products' (tokens × h by h × 4h) harmonic mean (the
rate of running all of them) over it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from planner.hardware import CPU_HERE
from primitives.launch import spawn
from primitives.log import console


def rate(m: int, k: int, n: int, reps: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times)


def mem_rate(nbytes: int, reps: int) -> float:
    x = torch.zeros(nbytes // 4)
    y = torch.zeros_like(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(x, 1.0, out=y)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)            # read x, write y


def adam_rate(n: int, reps: int) -> float:
    """Parameters per second torch's AdamW updates (on a CPU it is bound by its sqrt, not memory)."""
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4)
    opt.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def sweep(rank: int, world: int, quick: bool) -> dict:
    torch.set_num_threads(1)
    reps = 3 if quick else 7
    return {"square": [rate(n, n, n, reps) for n in ((256, 512) if quick else (256, 512, 1024))],
            "shaped": [rate(t, h, 4 * h, reps) for t, h in ((256, 64), (256, 128)) + (() if quick else ((512, 256),))],
            "bw": mem_rate(64 * 2**20, reps), "adam": adam_rate(2**22, reps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=CPU_HERE)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--ranks", type=int, default=2, help="processes measuring at once (as training ranks)")
    a = ap.parse_args(argv)
    got = spawn(sweep, a.ranks, args=(a.quick,), timeout=600)
    med = lambda key: [statistics.median(g[key][i] for g in got) for i in range(len(got[0][key]))]  # noqa: E731
    square, shaped = med("square"), med("shaped")
    peak = max(square + shaped)
    bw = statistics.median(g["bw"] for g in got)
    adam = statistics.median(g["adam"] for g in got)
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    doc = {"name": "cpu-here", "peak_flops": peak, "memory": total / 2, "mem_bandwidth": bw, "gpus_per_node": 2,
           "intra": None, "inter": None, "host_link": bw, "host_adam": adam, "gemm_efficiency": statistics.harmonic_mean(shaped) / peak,
           "reserved": 350 * 2**20, "bytes_per_elem": 4, "activations": "torch-eager-fp32",
           "calibrated_on": f"python -m benchmarks.planner_fit (matmul sweep, {a.ranks} ranks at once, load {open('/proc/loadavg').read().split()[0]})",
           "source": "measured here; links from primitives.engine.cost.FITTED (benchmarks.one_host)"}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    console.print(f"peak {peak / 1e9:.1f} GFLOP/s (squares {[round(r / 1e9, 1) for r in square]}, "
                  f"transformer-shaped {[round(r / 1e9, 1) for r in shaped]}), memory {bw / 1e9:.1f} GB/s, "
                  f"Adam {adam / 1e6:.0f} M params/s, gemm_efficiency {doc['gemm_efficiency']:.2f} → {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
