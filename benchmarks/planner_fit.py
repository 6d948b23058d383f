"""Fit the planner's `cpu-here` hardware file on this machine: a matmul sweep for the compute
rate, a large add for the memory rate; links come from benchmarks.one_host's α-β fit
(primitives.engine.cost.FITTED), read by planner.hardware.cpu_here.

    python -m benchmarks.planner_fit                 # writes planner/cpu_here.json (~10 s)
    python -m benchmarks.planner_fit --out /tmp/cpu.json --quick

One thread (what each rank gets: OMP_NUM_THREADS=1), fp32. peak_flops is the best rate of the
sweep; gemm_efficiency the median rate of the transformer-shaped products (tokens × h by h × 4h)
divided by it. Measured on a machine other jobs share: the rates are whatever the cores gave.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from planner.hardware import CPU_HERE
from primitives.log import console


def rate(m: int, k: int, n: int, reps: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / min(times)


def mem_rate(nbytes: int, reps: int) -> float:
    x = torch.zeros(nbytes // 4)
    y = torch.zeros_like(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(x, 1.0, out=y)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)            # read x, write y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=CPU_HERE)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    reps = 2 if a.quick else 5
    square = [rate(n, n, n, reps) for n in ((256, 512) if a.quick else (256, 512, 1024))]
    shaped = [rate(t, h, 4 * h, reps) for t, h in ((256, 64), (256, 128)) + (() if a.quick else ((512, 256),))]
    peak = max(square + shaped)
    bw = mem_rate(64 * 2**20, reps)
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    doc = {"name": "cpu-here", "peak_flops": peak, "memory": total / 2, "mem_bandwidth": bw, "gpus_per_node": 2,
           "intra": None, "inter": None, "host_link": bw, "host_adam": bw / 36, "gemm_efficiency": statistics.median(shaped) / peak,
           "reserved": 350 * 2**20, "bytes_per_elem": 4,
           "calibrated_on": "python -m benchmarks.planner_fit (matmul sweep on this machine, one thread)",
           "source": "measured here; links from primitives.engine.cost.FITTED (benchmarks.one_host)"}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    console.print(f"peak {peak / 1e9:.1f} GFLOP/s (squares {[round(r / 1e9, 1) for r in square]}, "
                  f"transformer-shaped {[round(r / 1e9, 1) for r in shaped]}), memory {bw / 1e9:.1f} GB/s, "
                  f"gemm_efficiency {doc['gemm_efficiency']:.2f} → {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
