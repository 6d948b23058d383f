"""What one all-reduce call costs on the default path (check on), against gloo's and MPICH's built-ins.

    python -m benchmarks.call_latency                      # N = 2 and 4; 4 B, 4 KiB, 64 KiB, 1 MiB (~1 min)
    python -m benchmarks.call_latency --n 2 --sizes 4,4096 --reps 1 --no-yield     (smoke run, ~5 s)
    python -m benchmarks.call_latency --n 2 --fifo    (ranks at real-time priority: an idle machine's numbers on a shared one)
    python -m benchmarks.call_latency --pin           (rank r pinned to core r mod cores)

For each N two mpiexec jobs hold MPICH's world and a gloo process group on the same ranks: one with
MPICH as a user gets it (it busy-polls), one with MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (it yields the core
while it waits: needed when ranks outnumber cores, ~40x slower at 4 B with N = 2 here); both MPICH
columns are shown, the goals are judged against the first. In each job each size times, in turn, `--reps` times: `primitives.all_reduce(t)`
(no option: check on, transport and algorithm auto; its plan is built by the warm-up call and
replayed after), the textbook function it runs called alone on the same shared-memory segment
(primitives/shm.py: no check, no ledger, no API; the difference is the engine's cost per call),
`dist.all_reduce(t)` on gloo, and `Allreduce(IN_PLACE)` of MPICH. A sample is the
slowest rank's mean over a batch of calls; the table shows the median sample in µs, the ratios of
the same run, and busbw = S/t·2(N-1)/N (nccl-tests). The goals: ≤ 15 µs at 4 B and 4 KiB (N = 2),
≤ 2× MPICH at 64 KiB, ≥ 1.5× MPICH's busbw from 1 MiB (MPICH as a user gets it). Without mpiexec it runs under torchrun,
without the MPICH column. Buffers are float32 zeros. --fifo runs the ranks under SCHED_FIFO
(`chrt -f 5`, needs root or CAP_SYS_NICE) so other jobs on a shared machine do not preempt them; only
for N ≤ cores (a busy-polling MPICH rank at real-time priority would never give up its core).
Where the ranks ran: per size, how many of ringzero's samples ended with its ranks on fewer cores
than they may use, min(N, cores) (each rank reads its core from /proc/self/stat as its batch ends); --pin pins rank r to core r mod cores for the run, to tell core placement from the
rest when runs disagree.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from rich.table import Table

import primitives as P
from benchmarks.one_host import _path, launcher
from benchmarks.one_host_worker import slowest, worlds
from figures.common import ROOT
from primitives import shm
from primitives.engine import planned, shm_collectives
from primitives.launch import free_port
from primitives.log import console

SIZES = (4, 4 << 10, 64 << 10, 1 << 20)


def cpu() -> int:
    """The core this process is running on now (/proc/self/stat's `processor`; -1 where unreadable)."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def worker(a) -> None:
    torch.set_num_threads(1)
    MPI, w = worlds(a.launcher, 120.0)
    if a.pin:                                      # rank r on core r mod cores, for the whole run
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[dist.get_rank() % len(cores)]})
    comm = P.get_comm()
    seg = shm_collectives.state(comm) if comm.transport == "shm" else None
    n, rows = dist.get_world_size(), []
    for S in a.sizes:
        t = torch.zeros(max(1, S // 4))
        fns = {"ringzero": lambda: P.all_reduce(t), "gloo": lambda: dist.all_reduce(t)}
        if comm.transport == "shm":               # the textbook function alone, on the same segment, on what
            fn = shm.shm_one_shot if shm_collectives.one_shot(S, n) else shm.shm_reduce_by_slices
            buf = memoryview(t.numpy()) if fn is shm.shm_one_shot and t.numel() <= planned.ITEMS else t
            fns["textbook"] = lambda fn=fn, buf=buf: fn(seg, buf, "sum")     # the plan passes it (planned.py)
        if w is not None:
            fns["mpich"] = lambda: w.Allreduce(MPI.IN_PLACE, t.numpy())
        iters = {}
        for k, fn in fns.items():                  # warm up (the first call builds the plan), size batches
            fn()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            iters[k] = max(5, min(2000, int(a.budget / max(slowest(time.perf_counter() - t0), 1e-7))))
        samples, shared = {k: [] for k in fns}, 0
        for _ in range(a.reps):
            for k, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters[k]):
                    fn()
                samples[k].append(slowest((time.perf_counter() - t0) / iters[k]))
                if k == "ringzero":                # where the ranks ran: two of them on one core?
                    cpus = [None] * n
                    dist.all_gather_object(cpus, cpu())
                    shared += len(set(cpus)) < min(n, len(os.sched_getaffinity(0)))
        rows.append(dict(n=n, size=S, med={k: statistics.median(v) for k, v in samples.items()},
                         spread={k: (min(v), max(v)) for k, v in samples.items()}, shared=(shared, a.reps)))
    if dist.get_rank() == 0:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, load=os.getloadavg()[0]), f)
    dist.barrier()
    dist.destroy_process_group()


def run(n: int, a, heavy_yield: bool = False) -> dict:
    how = launcher()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RINGZERO_TRANSPORT", "RINGZERO_HANDSHAKE", "MPIR_CVAR_ENABLE_HEAVY_YIELD")}
    env.update(OMP_NUM_THREADS="1", PATH=_path(), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    if heavy_yield:
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    out = os.path.join(a.tmp, f"n{n}{'y' if heavy_yield else ''}.json")
    head = (["mpiexec", "-n", str(n), sys.executable] if how == "mpiexec" else
            ["torchrun", "--standalone", f"--nproc_per_node={n}", f"--master_port={free_port()}"])
    if a.fifo and n <= (os.cpu_count() or 1):
        head = ["chrt", "-f", "5"] + head
    elif a.fifo:
        console.print(f"[yellow]--fifo ignored for N = {n}: more ranks than cores[/]")
    cmd = head + ["-m", "benchmarks.call_latency", "--worker", "--launcher", how, "--json", out, "--reps",
                  str(a.reps), "--budget", str(a.budget), "--sizes", ",".join(map(str, a.sizes))] + (
                      ["--pin"] if a.pin else [])
    console.print(f"[dim]{' '.join(cmd)}[/]", soft_wrap=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def _size(S: int) -> str:
    return f"{S >> 20} MiB" if S >= 1 << 20 else f"{S >> 10} KiB" if S >= 1 << 10 else f"{S} B"


def goal(n: int, S: int, med: dict) -> str:
    r, m = med["ringzero"], med.get("mpich")
    if n == 2 and S <= 4096:
        return ("met" if r <= 15e-6 else "missed") + " (≤ 15 µs)"
    if m is None:
        return "-"
    if S < 1 << 20:
        lim = 2 if n == 2 else 3
        return ("met" if r <= lim * m else "missed") + f" (≤ {lim}× MPICH)"
    lim = 1.5 if n == 2 else 1.0
    return ("met" if m / r >= lim else "missed") + f" (busbw ≥ {lim}× MPICH)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="2,4", help="comma list of world sizes")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma list of bytes")
    ap.add_argument("--reps", type=int, default=7, help="interleaved samples per contender and size")
    ap.add_argument("--budget", type=float, default=0.02, help="seconds per sample (batch sized to it)")
    ap.add_argument("--yield", dest="heavy_yield", action=argparse.BooleanOptionalAction, default=True,
                    help="also time MPICH with MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (a second mpiexec job)")
    ap.add_argument("--fifo", action="store_true", help="ranks at real-time priority (chrt -f 5; N ≤ cores only)")
    ap.add_argument("--pin", action="store_true", help="rank r pinned to core r mod cores (sched_setaffinity)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--launcher", default="torchrun", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",")]
    if a.worker:
        return worker(a)
    tab = Table(title="all_reduce per call, median µs (slowest rank; min–max of the samples in brackets)")
    for c in ("N", "size", "ringzero (default, check on)", "textbook function alone", "MPICH", "MPICH HEAVY_YIELD=1",
              "gloo", "ringzero / MPICH",
              "gloo / ringzero", "busbw GB/s ringzero | MPICH", "goal"):
        tab.add_column(c, justify="right")
    loads, placed = [], []
    with tempfile.TemporaryDirectory() as a.tmp:
        for n in (int(x) for x in a.n.split(",")):
            res = run(n, a)
            yld = run(n, a, heavy_yield=True) if launcher() == "mpiexec" and a.heavy_yield else {"rows": [{}] * len(res["rows"])}
            loads += [res["load"]] + ([yld["load"]] if "load" in yld else [])
            for row, yrow in zip(res["rows"], yld["rows"]):
                S, med, sp = row["size"], row["med"], row["spread"]
                if "mpich" in yrow.get("med", {}):
                    med["mpich_yield"], sp["mpich_yield"] = yrow["med"]["mpich"], yrow["spread"]["mpich"]
                us = lambda k: (f"{med[k] * 1e6:,.1f} [{sp[k][0] * 1e6:,.0f}–{sp[k][1] * 1e6:,.0f}]"  # noqa: E731
                                if k in med else "-")
                bw = lambda k: f"{S / med[k] * 2 * (n - 1) / n / 1e9:.2f}" if k in med else "-"  # noqa: E731
                tab.add_row(str(n), _size(S), us("ringzero"), us("textbook"), us("mpich"), us("mpich_yield"), us("gloo"),
                            f"{med['ringzero'] / med['mpich']:.2f}" if "mpich" in med else "-",
                            f"{med['gloo'] / med['ringzero']:.1f}", f"{bw('ringzero')} | {bw('mpich')}",
                            goal(n, S, med))
                placed.append(f"N = {n} {_size(S)}: {row['shared'][0]} of {row['shared'][1]}")
    console.print(tab)
    console.print(f"load average during the runs: {', '.join(f'{x:.1f}' for x in loads)} on {os.cpu_count()} cores "
                  "(numbers measured under that load; ±30 % noise is normal here)"
                  + ("; N ≤ cores ran at real-time priority (--fifo)" if a.fifo else "")
                  + ("; rank r pinned to core r mod cores (--pin)" if a.pin else ""))
    console.print("ringzero's samples that ended with its ranks on fewer cores than they may use (each rank "
                  "reads its core as its batch ends): " + "; ".join(placed))


if __name__ == "__main__":
    main()
