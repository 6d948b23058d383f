"""`primitives/run.py all_to_all`: check both all-to-all algorithms (even and uneven splits)
against the backend's own, the ledger against traffic(), and time them.

    torchrun --nproc_per_node 4 primitives/run.py all_to_all [--size 1048576] [--iters 5]
    mpiexec -n 4 python primitives/run.py all_to_all --backend mpi

torch 2.13's gloo has the even and uneven single forms, but its list form refuses tensors of
different sizes: the reference (`builtin`) sends those through gloo's uneven single form instead.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.table import Table

from primitives.engine.algos import ALGORITHMS
from primitives.engine.calls.all_to_all import all_to_all_single
from primitives.launch import add_launch_args, init_from_env
from primitives.engine.ledger import LEDGER
from primitives.log import print0
from primitives.engine.traffic import traffic


def builtin(name, comm, *args, **kw):
    """The backend's own all-to-all (the reference): torch.distributed, or mpi4py's Alltoallv."""
    if comm.backend != "mpi":
        out, inp = args
        if name == "all_to_all" and len({tuple(t.shape) for t in [*out, *inp]}) > 1:
            # gloo's list form needs every tensor the same size ("input and output tensors must
            # have the same size"); its uneven single form does not, so route through that
            sc, rc = [t.numel() for t in inp], [t.numel() for t in out]
            recv = torch.empty(sum(rc), dtype=inp[0].dtype)
            torch.distributed.all_to_all_single(recv, torch.cat([t.reshape(-1) for t in inp]), rc, sc, group=comm.group)
            for t, piece in zip(out, recv.split(rc)):
                t.copy_(piece.view_as(t))
            return None
        return getattr(torch.distributed, name)(*args, group=comm.group, **kw)
    from mpi4py import MPI   # optional dependency: only `--backend mpi` needs it
    if name == "all_to_all":
        out, inp = args
        send = torch.cat([t.reshape(-1) for t in inp])
        recv = torch.empty(sum(t.numel() for t in out), dtype=send.dtype)
        sc, rc = [t.numel() for t in inp], [t.numel() for t in out]
    else:
        out, inp = args
        row = inp[0].numel() if inp.shape[0] else 0
        n = comm.size
        sc = [s * row for s in (kw.get("input_split_sizes") or [inp.shape[0] // n] * n)]
        rc = [s * row for s in (kw.get("output_split_sizes") or [out.shape[0] // n] * n)]
        send, recv = inp.contiguous().reshape(-1), torch.empty(out.numel(), dtype=out.dtype)
    es = send.element_size()
    spec = lambda t, c: [t.view(torch.uint8).numpy(), [x * es for x in c], [sum(c[:i]) * es for i in range(len(c))], MPI.BYTE]  # noqa: E731
    comm.mpi.Alltoallv(spec(send, sc), spec(recv, rc))
    if name == "all_to_all":
        for t, piece in zip(out, recv.split(rc)):
            t.copy_(piece.view_as(t))
    else:
        out.copy_(recv.view_as(out))


def main(argv=None) -> None:
    """Check both algorithms (even and uneven splits) against the built-in, the ledger against
    cost.traffic, and time them interleaved with the built-in."""
    ap = argparse.ArgumentParser(description="Run, verify and time every all-to-all algorithm.")
    add_launch_args(ap)
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes of each rank's input (default 1 MiB)")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    comm = init_from_env(a.backend, a.timeout)
    n, r = comm.size, comm.rank
    rows = max(n, a.size // 4 // n * n)
    uneven = [((r + p) % 3) * rows // (2 * n) for p in range(n)]          # rank r sends uneven[p] rows to p
    uneven[r] += rows - sum(uneven)
    got = [((p + r) % 3) * rows // (2 * n) if p != r else 0 for p in range(n)]
    got[r] = uneven[r]
    x = torch.randint(-9, 9, (rows,), dtype=torch.float32)
    t = Table(title=f"all_to_all_single: {n} ranks, {rows * 4:,} bytes per rank, backend {comm.backend}")
    for c in ("algorithm", "splits", "check vs built-in", "bytes sent (rank 0)", "= formula", "median ms (ours)",
              "median ms (built-in)", "busbw GB/s"):
        t.add_column(c, justify="left" if c in ("algorithm", "splits", "check vs built-in") else "right")
    bad = 0
    for algo in [*ALGORITHMS["all_to_all_single"], "auto"]:
        for label, ins, outs in (("even", None, None), ("uneven", uneven, got)):
            y, ref = torch.empty(sum(outs) if outs else rows), torch.empty(sum(outs) if outs else rows)
            with LEDGER.track() as d:
                all_to_all_single(comm, y, x, outs, ins, algorithm=algo)
            builtin("all_to_all_single", comm, ref, x, output_split_sizes=outs, input_split_sizes=ins)
            exp = traffic("all_to_all_single", LEDGER.calls[-1].algorithm, n, r, rows, 4, splits=ins)
            ok, fok = torch.equal(y, ref), (d.msgs_sent, d.bytes_sent) == exp
            bad += (not ok) + (not fok)
            times = {"ours": [], "ref": []}
            for _ in range(a.iters):                                      # interleaved
                for side in ("ours", "ref"):
                    torch.distributed.barrier(group=comm.group) if comm.backend != "mpi" else comm.mpi.Barrier()
                    t0 = time.perf_counter()
                    if side == "ours":
                        all_to_all_single(comm, y, x, outs, ins, algorithm=algo)
                    else:
                        builtin("all_to_all_single", comm, ref, x, output_split_sizes=outs, input_split_sizes=ins)
                    times[side].append(time.perf_counter() - t0)
            mo, mr = statistics.median(times["ours"]), statistics.median(times["ref"])
            t.add_row(algo, label, "[green]pass[/]" if ok else "[red]FAIL[/]", f"{d.bytes_sent:,}",
                      "[green]yes[/]" if fok else "[red]NO[/]", f"{mo * 1e3:.3f}", f"{mr * 1e3:.3f}",
                      f"{rows * 4 / mo * (n - 1) / n / 1e9:.3f}" if n > 1 else "-")
    print0(t)
    print0("busbw = S / time × (N-1)/N, S = this rank's input. Timings include the handshake (the default).")
    if bad:
        raise SystemExit(f"rank {r}: {bad} check(s) failed")
