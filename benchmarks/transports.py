"""Transports on one host, interleaved in one run: ringzero on shared memory vs gloo's
built-in (TCP loopback) vs MPICH's built-in (its own shared memory), plus α-β per transport.

    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 2 python benchmarks/transports.py
    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 4 python benchmarks/transports.py --max-bytes 16M --fit

One mpiexec job holds both worlds: MPI's COMM_WORLD and a gloo process group on the same
ranks (rendezvous on a port rank 0 picks), so every contender runs on the same processes,
size after size, in turn (`--reps` times, each the mean of `iters` calls; median and min–max
shown). ringzero runs its default path (--algorithm auto; shm: shm_collectives) with the argument check (handshake)
ON. busbw as nccl-tests: all-reduce S/t·2(N-1)/N, all-gather/reduce-scatter S/t·(N-1)/N, S the
full buffer. The ceiling: all_reduce also times "memcpy", every rank copying S bytes at once,
interleaved like the others; the ratio printed is ringzero's busbw / that copy's S/t at the same
S (and, once, one core copying 64 MiB: benchmarks.collectives.memcpy_bw).
--fit: one-way ping-pong between ranks 0 and 1 on each transport, t(S) = α + S·β (bench.py's fit).
Buffers are zeros (repeated in-place all-reduce of random data would overflow).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from rich.table import Table

import primitives as P
from benchmarks.collectives import memcpy_bw, parse_size, pingpong_fit, sizes_between
from primitives.engine.comms import CheckedTorchComm
from primitives.launch import free_port
from primitives.log import print0
from primitives.engine.mpi_comm import MPIComm

FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n}


def _worlds(timeout):
    from mpi4py import MPI   # optional dependency: this benchmark runs under mpiexec only
    w = MPI.COMM_WORLD
    port = w.bcast(free_port() if w.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=w.rank, world_size=w.size,
                            timeout=timedelta(seconds=timeout))
    return MPI, w


def contenders(op, S, n, comm, MPI, w, algo="auto"):
    """name -> zero-argument call, on buffers of S bytes (the full buffer, float32); ringzero's
    with algorithm=algo."""
    full, blk = S // 4, max(1, S // 4 // n)
    if op == "all_reduce":
        a, b, c, d, e = (torch.zeros(full) for _ in range(5))
        return {"ringzero": lambda: P.all_reduce(a, algorithm=algo),
                "gloo": lambda: dist.all_reduce(b),
                "mpich": lambda: w.Allreduce(MPI.IN_PLACE, c.numpy()),
                "memcpy": lambda: d.copy_(e)}          # every rank copies S bytes at once: the ceiling
    if op == "all_gather":
        i, o1, o2, o3 = torch.zeros(blk), torch.zeros(n * blk), torch.zeros(n * blk), torch.zeros(n * blk)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return {"ringzero": lambda: P.all_gather_single(o1, i, algorithm=algo),
                "gloo": lambda: ag(o2, i),
                "mpich": lambda: w.Allgather(i.numpy(), o3.numpy())}
    i, o1, o2, o3 = torch.zeros(n * blk), torch.zeros(blk), torch.zeros(blk), torch.zeros(blk)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {"ringzero": lambda: P.reduce_scatter_single(o1, i, algorithm=algo),
            "gloo": lambda: rs(o2, i),
            "mpich": lambda: w.Reduce_scatter_block(i.numpy(), o3.numpy())}


def sweep(ops, sizes, reps, comm, MPI, w, budget_s=0.05, algo="auto"):
    n, rows = w.size, []
    for op in ops:
        for S in sizes:
            fns = contenders(op, S, n, comm, MPI, w, algo)
            iters = {}
            for k, fn in fns.items():                  # warm up; size iterations to ~budget_s
                fn(), fn()
                w.Barrier()
                t0 = time.perf_counter()
                fn()
                iters[k] = max(2, min(200, int(budget_s / max(w.allreduce(time.perf_counter() - t0, op=MPI.MAX), 1e-6))))
            samples = {k: [] for k in fns}
            for _ in range(reps):
                for k, fn in fns.items():
                    w.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters[k]):
                        fn()
                    samples[k].append(w.allreduce((time.perf_counter() - t0) / iters[k], op=MPI.MAX))
            used = P.LEDGER.calls[-1].algorithm if P.LEDGER.calls else "?"
            for k, ts in samples.items():
                med = statistics.median(ts)
                rows.append(dict(op=op, size=S, impl=k, algo=used if k == "ringzero" else "", median=med,
                                 lo=min(ts), hi=max(ts), busbw=S / med * (1 if k == "memcpy" else FACTOR[op](n)) / 1e9))
            P.LEDGER.calls.clear()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fit", action="store_true", help="ping-pong α-β fit for each transport")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--algorithm", default="auto", help="ringzero's algorithm= (auto: the default path; shm: shm_collectives)")
    args = ap.parse_args(argv)
    MPI, w = _worlds(args.timeout)
    comm = P.get_comm()
    torch.set_num_threads(1)
    n = w.size
    print0(f"ringzero transport: {comm.transport} (RINGZERO_TRANSPORT={os.environ.get('RINGZERO_TRANSPORT', 'auto')}), "
           f"{n} ranks, handshake {'on' if P.handshake_enabled() else 'off'}, torch {torch.__version__}, "
           f"MPICH {MPI.Get_library_version().split(chr(10))[0]}, "
           f"MPIR_CVAR_ENABLE_HEAVY_YIELD={os.environ.get('MPIR_CVAR_ENABLE_HEAVY_YIELD', 'unset')}")
    rows = sweep(args.ops.split(","), sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes)),
                 args.reps, comm, MPI, w, algo=args.algorithm)
    ceiling = memcpy_bw()
    for op in args.ops.split(","):
        t = Table(title=f"{op}, {n} ranks, float32: busbw GB/s (median of {args.reps} interleaved reps; min–max µs)")
        for c in ("size", "ringzero (shm) → algo", "gloo", "mpich", "ringzero/gloo", "ringzero/mpich",
                  "ringzero µs", "gloo µs", "mpich µs"):
            t.add_column(c, justify="right")
        for S in sorted({r["size"] for r in rows if r["op"] == op}):
            by = {r["impl"]: r for r in rows if r["op"] == op and r["size"] == S}
            us = lambda k: f"{by[k]['median'] * 1e6:,.0f} ({by[k]['lo'] * 1e6:,.0f}–{by[k]['hi'] * 1e6:,.0f})"  # noqa: E731
            t.add_row(f"{S:,}", f"{by['ringzero']['busbw']:.3f} → {by['ringzero']['algo']}", f"{by['gloo']['busbw']:.3f}",
                      f"{by['mpich']['busbw']:.3f}", f"{by['ringzero']['busbw'] / by['gloo']['busbw']:.2f}×",
                      f"{by['ringzero']['busbw'] / by['mpich']['busbw']:.2f}×", us("ringzero"), us("gloo"), us("mpich"))
        print0(t)
    cp = {r["size"]: r["busbw"] for r in rows if r["impl"] == "memcpy"}
    for r in (r for r in rows if r["op"] == "all_reduce" and r["impl"] == "ringzero"):
        print0(f"all_reduce {r['size']:>12,} B: ringzero busbw {r['busbw']:.3f} GB/s / memcpy of the same S on every "
               f"rank at once {cp[r['size']]:.3f} GB/s = {r['busbw'] / cp[r['size']]:.2f}")
    big = [r for r in rows if r["op"] == "all_reduce" and r["impl"] == "ringzero"]
    if big:
        r = max(big, key=lambda r: r["size"])
        print0(f"memcpy ceiling (one core, 64 MiB): {ceiling:.2f} GB/s; ringzero all_reduce at {r['size']:,} B: "
               f"busbw {r['busbw']:.2f} GB/s = {r['busbw'] / ceiling:.2f} of the ceiling")
    if args.fit and n >= 2:
        t = Table(title="point-to-point ping-pong, ranks 0 ↔ 1: t(S) = α + S·β")
        for c in ("transport", "α µs", "β ns/B", "1/β GB/s", "t(8 B) µs", "t(4 MiB) µs"):
            t.add_column(c, justify="right")
        for name, c in (("shm (ringzero)", comm), ("tcp (gloo)", CheckedTorchComm()), ("mpich", MPIComm(w))):
            params, pts = pingpong_fit(c, 20)
            pt = dict(pts)
            t.add_row(name, f"{params.alpha * 1e6:.1f}", f"{params.beta * 1e9:.3f}", f"{1 / params.beta / 1e9:.2f}",
                      f"{pt[8] * 1e6:.1f}", f"{pt[1 << 22] * 1e6:.0f}")
        print0(t)
    w.Barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
