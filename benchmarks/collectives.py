"""nccl-tests-style sweep: from-scratch collectives vs the backend's built-in, side by side.

    torchrun --standalone --nproc_per_node 4 benchmarks/collectives.py
    RINGZERO_TRANSPORT=tcp torchrun --standalone --nproc_per_node 2 benchmarks/collectives.py   (the transport column says which ran)
    torchrun --standalone --nproc_per_node 2 benchmarks/collectives.py --ops all_reduce --fit --json out.json
    mpiexec -n 4 python benchmarks/collectives.py --backend mpi

For each size (the full buffer S, as nccl-tests counts it) and op, every implementation is
timed in turn, `--reps` times (interleaved so drifting load hits all sides alike), each rep
the mean over `--iters` calls after warm-up; the table shows the median rep and the min–max.
    algbw = S / t        busbw = algbw × factor   (2(n-1)/n all-reduce; (n-1)/n all-gather,
                                                   reduce-scatter, gather, scatter; 1 broadcast, reduce)
--fit runs a ping-pong between ranks 0 and 1, fits t = α + S·β, measures γ (the reduction's
seconds per byte) and prints the cost model's predicted time next to the measured one, and the
sizes where algorithm="auto" switches (auto reads cost.FITTED, fitted to the algorithms' own times
by `python -m benchmarks.one_host`; a ping-pong alone misses what a collective adds to its messages).
The machine's memcpy bandwidth is printed as the ceiling.
Buffers are zeros: repeated in-place all-reduce of random data overflows.

Every algorithm is timed twice: as a user gets it (the default: the call check on, whose
envelopes carry small calls' data, primitives/engine/envelope.py) and "unchecked" (set_handshake(False)).
The "check cost" column is t(default) / t(unchecked) - 1 for the same algorithm name.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.progress import Progress
from rich.table import Table

from primitives.engine import api, core, planned
from primitives.engine.cost import Params, choose, family, predict
from primitives.engine.cost import params as fitted
from primitives.engine.ledger import LEDGER
from primitives.launch import add_launch_args, init_from_env
from primitives.log import print0
from primitives.engine.reference import ref
from primitives.engine.runner import Case, barrier, bus_factor


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1]) * mult) if s[-1:] in "KMG" else int(s)


def sizes_between(lo: int, hi: int, factor: int = 4) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def timed(fn, comm, iters: int) -> float:
    barrier(comm)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def per_rank_numel(op: str, size: int, n: int, esz: int) -> int:
    full = size // esz
    return full if op in ("all_reduce", "broadcast", "reduce") else max(1, full // n)


def sweep(comm, ops, algos, sizes, iters, warmup, reps, dtype):
    n, rows = comm.size, []
    transport = getattr(comm, "transport", comm.backend)     # shm / tcp / shm+tcp (primitives/engine/shm.py)
    esz = torch.empty(0, dtype=dtype).element_size()
    for op in ops:
        for size in sizes:
            case = Case(op, comm, per_rank_numel(op, size, n, esz), dtype, 0, fill="zeros")
            impls = {"built-in": (lambda a=case.args()[0]: ref(op, comm, *a))}
            for al in algos:
                if al == "auto" or al in api.algorithms_for(op, comm):
                    a = case.args()[0]
                    impls[al] = (lambda a=a, al=al: getattr(api, op)(*a, algorithm=al))
                    impls[al + " unchecked"] = (lambda a=a, al=al: _unchecked(getattr(api, op), *a, algorithm=al))
            for fn in impls.values():
                for _ in range(warmup):
                    fn()
            samples = {k: [] for k in impls}
            for _ in range(reps):
                for k, fn in impls.items():
                    samples[k].append(timed(fn, comm, iters))
            S = case.bus_bytes()
            ref_bus = None
            for k, ts in samples.items():
                med = statistics.median(ts)
                bus = S / med * bus_factor(op, n) / 1e9 if n > 1 else 0.0
                ref_bus = bus if k == "built-in" else ref_bus
                chosen = _chosen(op, comm, S, checked=not k.endswith("unchecked")) if k.startswith("auto") else ""
                unchecked = samples.get(k + " unchecked")
                cost = med / statistics.median(unchecked) - 1 if unchecked else None
                rows.append(dict(op=op, size=S, impl=k, chosen=chosen,
                                 transport=comm.backend if k == "built-in" else transport, median_s=med, min_s=min(ts),
                                 max_s=max(ts), algbw=S / med / 1e9, busbw=bus, ratio=(bus / ref_bus) if ref_bus else None,
                                 check_cost=cost))
    return rows


def _unchecked(fn, *args, **kw):
    core.set_handshake(False)
    try:
        fn(*args, **kw)
    finally:
        core.set_handshake(True)


def _chosen(op, comm, S, checked: bool) -> str:
    """What algorithm="auto" runs for this call (with the check on, small calls fuse into it)."""
    core.set_handshake(checked)
    try:
        transport = getattr(comm, "transport", None)
        if transport != "shm" and op in planned.FUSED and planned.fuses(op, planned.FUSED[op][0], comm, S):
            return planned.FUSED[op][0]
        return choose(op, comm.size, S, comm.backend, transport)
    finally:
        core.set_handshake(True)


def pingpong_fit(comm, iters: int):
    """Rank 0 and 1 bounce a message; one-way time t(S) = α + S·β by least squares."""
    pts = []
    for S in (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24):
        buf = torch.zeros(S, dtype=torch.uint8, device=comm.device)
        ts = []
        for _ in range(3):
            barrier(comm)
            t0 = time.perf_counter()
            for _ in range(iters):
                if comm.rank == 0:
                    comm.send(buf, 1)
                    comm.recv(buf, 1)
                elif comm.rank == 1:
                    comm.recv(buf, 0)
                    comm.send(buf, 0)
            ts.append((time.perf_counter() - t0) / iters / 2)
        pts.append((S, statistics.median(ts)))
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - beta * mx, pts[0][1] * 0.5)
    a = torch.zeros(1 << 22)
    b = torch.zeros(1 << 22)
    t0 = time.perf_counter()
    for _ in range(10):
        a.add_(b)
    gamma = (time.perf_counter() - t0) / 10 / a.numel() / a.element_size()
    return Params(alpha, beta, gamma), pts


def memcpy_bw() -> float:
    a, b = torch.empty(1 << 24), torch.zeros(1 << 24)
    a.copy_(b)
    t0 = time.perf_counter()
    for _ in range(5):
        a.copy_(b)
    return a.numel() * a.element_size() * 5 / (time.perf_counter() - t0) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_launch_args(ap)
    ap.add_argument("--ops", default="all_reduce,all_gather_single,reduce_scatter_single")
    ap.add_argument("--algorithms", default="auto", help="comma list, or 'all'")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--sizes", help="comma list of sizes instead of the ×4 sweep, e.g. 4K,64K,1M,16M,64M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fit", action="store_true", help="ping-pong α-β fit and predicted vs measured")
    ap.add_argument("--json", help="write all rows to this file (rank 0)")
    args = ap.parse_args(argv)
    comm = init_from_env(args.backend, args.timeout)
    LEDGER.keep_calls = False
    n, dtype = comm.size, getattr(torch, args.dtype)
    ops = args.ops.split(",")
    algos = sorted({a for op in ops for a in api.algorithms_for(op, comm)}) + ["auto"] if args.algorithms == "all" \
        else args.algorithms.split(",")
    sizes = ([parse_size(s) for s in args.sizes.split(",")] if args.sizes
             else sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes)))
    if n == 1:
        print0("[yellow]World size 1: nothing to measure. Run: torchrun --standalone --nproc_per_node 4 benchmarks/collectives.py[/]")
        return
    rows = []
    with Progress(disable=comm.rank != 0, transient=True) as prog:
        task = prog.add_task("sweeping", total=len(ops) * len(sizes))
        for op in ops:
            for s in sizes:
                rows += sweep(comm, [op], algos, [s], args.iters, args.warmup, args.reps, dtype)
                prog.advance(task)
    result = dict(backend=comm.backend, world_size=n, dtype=args.dtype, rows=rows, memcpy_GBps=memcpy_bw())
    for op in ops:
        t = Table(title=f"{op}: {n} ranks, backend {comm.backend}, {args.dtype} (median of {args.reps} reps × {args.iters} iters)")
        for c in ("size", "impl", "transport", "median µs", "min–max µs", "algbw GB/s", "busbw GB/s",
                  "busbw vs built-in", "check cost"):
            t.add_column(c, justify="left" if c == "impl" else "right")
        for r in (r for r in rows if r["op"] == op):
            impl = r["impl"] + (f" → {r['chosen']}" if r["chosen"] else "")
            ratio = "" if r["ratio"] is None else (f"[green]{r['ratio']:.2f}×[/]" if r["ratio"] >= 1 else f"[red]{r['ratio']:.2f}×[/]")
            cost = "" if r["check_cost"] is None else f"{r['check_cost'] * 100:+.0f}%"
            t.add_row(f"{r['size']:,}", impl, r["transport"], f"{r['median_s'] * 1e6:,.0f}",
                      f"{r['min_s'] * 1e6:,.0f}–{r['max_s'] * 1e6:,.0f}", f"{r['algbw']:.3f}", f"{r['busbw']:.3f}", ratio, cost)
        print0(t)
    print0(f"memcpy ceiling on this machine: {result['memcpy_GBps']:.2f} GB/s (one core, 64 MiB copy)")
    if args.fit:
        params, pts = pingpong_fit(comm, args.iters)
        result["fit"] = dict(alpha=params.alpha, beta=params.beta, gamma=params.gamma, pingpong=pts)
        print0(f"ping-pong fit: α = {params.alpha * 1e6:.1f} µs, β = {params.beta * 1e9:.3f} ns/byte "
               f"({1 / params.beta / 1e9:.2f} GB/s), γ = {params.gamma * 1e9:.3f} ns/byte "
               f"(cost.py's fitted ring on this transport: {fitted(family('ring', getattr(comm, 'transport', None), comm.backend), n)}; "
               "the fit to the algorithms' own times: python -m benchmarks.one_host)")
        t = Table(title="cost model vs measured (all_reduce)")
        for c in ("size", "algorithm", "predicted µs", "measured µs", "predicted/measured"):
            t.add_column(c, justify="right")
        for r in (r for r in rows if r["op"] == "all_reduce" and r["impl"] != "built-in"):
            # auto rows are predicted for the algorithm auto ran; the model has no term for the check
            algo = r["chosen"] or r["impl"].replace(" unchecked", "")
            pred = predict("all_reduce", algo, n, r["size"], params)
            t.add_row(f"{r['size']:,}", r["impl"] + (f" → {algo}" if r["chosen"] else ""), f"{pred * 1e6:,.0f}",
                      f"{r['median_s'] * 1e6:,.0f}", f"{pred / r['median_s']:.2f}")
        print0(t)
        for op in ops:
            prev, spans = None, []
            for s in sizes_between(1 << 10, 1 << 28, 2):
                c = choose(op, n, s, comm.backend, getattr(comm, "transport", None))
                if c != prev:
                    spans.append(f"{s:,} B → {c}")
                    prev = c
            print0(f"auto for {op} at N={n}: " + "; ".join(spans))
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print0(f"wrote {args.json}")


if __name__ == "__main__":
    main()
