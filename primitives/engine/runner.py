"""What `primitives/allreduce.py` (and run.py NAME) does: run each algorithm, check it against the
backend's built-in (reference.py), compare the bytes sent with the formula, time it, and print a table.

    torchrun --nproc_per_node 4 primitives/allreduce.py [--size 1048576] [--iters 5]
    mpiexec -n 4 python primitives/run.py broadcast --backend mpi
    torchrun --nproc_per_node 4 primitives/run.py all_to_all      (main_all_to_all: even and uneven splits)

Inputs are small integers stored in the chosen dtype, so every summation order gives the same
exact result and the check against the built-in can be bitwise.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from rich.table import Table

from primitives.engine import api, core
from primitives.engine.algos import ALGORITHMS
from primitives.engine.ledger import LEDGER
from primitives.engine.traffic import traffic
from primitives.launch import add_launch_args, init_from_env
from primitives.log import fail, print0
from primitives.engine.reference import ref
from primitives.engine.subcomm import shape

ROOTED = ("broadcast", "reduce", "scatter", "gather")
# nccl-tests' busbw factors; S is the full buffer for the gather/scatter family
def bus_factor(name: str, n: int) -> float:
    return 2 * (n - 1) / n if name == "all_reduce" else 1.0 if name in ("broadcast", "reduce") else (n - 1) / n


class Case:
    """Fresh arguments for one call of `name` (ours and the reference get separate copies)."""

    def __init__(self, name: str, comm, numel: int, dtype, root: int, fill: str = "ints"):
        self.name, self.comm, self.numel, self.dtype, self.root = name, comm, numel, dtype, root
        n, r = comm.size, comm.rank
        dev = comm.device
        g = torch.Generator().manual_seed(1234 + r)

        def data(k):
            if fill == "zeros":
                return torch.zeros(k, dtype=dtype, device=dev)
            return torch.randint(-3, 4, (k,), generator=g).to(dtype).to(dev)
        if name in ("broadcast", "reduce", "all_reduce", "all_gather", "all_gather_single", "gather"):
            self.x = data(numel)
        elif name in ("reduce_scatter", "reduce_scatter_single"):
            self.x = data(n * numel)
        elif name == "scatter":
            self.x = data(n * numel) if r == root else None

    def args(self):
        """(args, outputs): a fresh copy of the call's arguments and the tensors to compare."""
        n, r, name, k = self.comm.size, self.comm.rank, self.name, self.numel
        dev, dt = self.comm.device, self.dtype
        z = lambda m: torch.zeros(m, dtype=dt, device=dev)  # noqa: E731
        if name in ("broadcast", "reduce"):
            t = self.x.clone()
            return (t, self.root), [t] if name == "broadcast" or r == self.root else []
        if name == "all_reduce":
            t = self.x.clone()
            return (t,), [t]
        if name == "all_gather":
            out = [z(k) for _ in range(n)]
            return (out, self.x), out
        if name == "all_gather_single":
            out = z(n * k)
            return (out, self.x), [out]
        if name == "reduce_scatter":
            out = z(k)
            return (out, list(self.x.tensor_split(n))), [out]
        if name == "reduce_scatter_single":
            out = z(k)
            return (out, self.x), [out]
        if name == "scatter":
            out = z(k)
            return (out, list(self.x.tensor_split(n)) if r == self.root else None, self.root), [out]
        if name == "gather":
            out = [z(k) for _ in range(n)] if r == self.root else None
            return (self.x, out, self.root), out or []

    def bus_bytes(self) -> int:
        """S as nccl-tests defines it for algbw: the full buffer for the gather/scatter family."""
        esz = torch.empty(0, dtype=self.dtype).element_size()
        full = self.numel * (self.comm.size if self.name not in ("broadcast", "reduce", "all_reduce") else 1)
        return full * esz


def barrier(comm):
    if comm.backend == "mpi":
        comm.mpi.Barrier()
    else:
        torch.distributed.barrier(group=comm.group)


def all_ok(comm, ok: bool) -> bool:
    """Every rank's verdict combined with the backend's own all-reduce (MIN)."""
    if comm.backend == "mpi":
        from mpi4py import MPI   # optional dependency: only `--backend mpi` needs it
        return bool(comm.mpi.allreduce(int(ok), op=MPI.MIN))
    t = torch.tensor([int(ok)], device=comm.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=comm.group)
    return bool(t.item())


def time_call(fn, comm, iters: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        barrier(comm)
        t0 = time.perf_counter()
        fn()
        if comm.device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main(name: str, argv=None) -> None:
    ap = argparse.ArgumentParser(description=f"Run, verify and time every {name} algorithm.")
    add_launch_args(ap)
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes per rank's tensor (default 1 MiB)")
    ap.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64", "int32", "int64"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--root", type=int, default=0, help="src/dst for rooted collectives")
    valid = ALGORITHMS[name] + ["auto"]
    ap.add_argument("--algorithms", default=",".join(valid), help=f"comma list of {', '.join(valid)}")
    args = ap.parse_args(argv)
    bad = [a for a in args.algorithms.split(",") if a not in valid]
    if bad:   # refuse at parsing, not at the collective's safety check after a long traceback
        ap.error(f"--algorithms: {', '.join(map(repr, bad))} is not a {name} algorithm; expected a comma list of "
                 f"{', '.join(valid)}")
    comm = init_from_env(args.backend, args.timeout)
    n = comm.size
    dtype = getattr(torch, args.dtype)
    numel = max(1, args.size // torch.empty(0, dtype=dtype).element_size())
    root = args.root if name in ROOTED else 0
    if not 0 <= root < n:
        fail(f"rank {comm.rank}: --root {root} is out of range for world size {n}: expected 0 ≤ root ≤ {n - 1}")
    if n == 1:
        print0(f"[yellow]World size 1: {name} has nobody to talk to, so every algorithm is a local copy.[/]\n"
               f"  For more ranks: [bold]torchrun --nproc_per_node 4 primitives/{name}.py[/]\n"
               f"  or with MPI:    [bold]mpiexec -n 4 python primitives/{name}.py --backend mpi[/]")
    case = Case(name, comm, numel, dtype, root)
    table = Table(title=f"{name}: {n} ranks, {args.size:,} bytes per rank, {args.dtype}, backend {comm.backend}")
    for col in ("algorithm", "ran", "check vs built-in", "bytes sent (rank 0)", "formula (rank 0)",
                "every rank = formula", "msgs (rank 0)", "median ms", "busbw GB/s"):
        table.add_column(col, justify="right" if col not in ("algorithm", "ran", "check vs built-in") else "left")
    failures = 0
    for algo in args.algorithms.split(","):
        a_ours, outs = case.args()
        a_ref, refs = case.args()
        with LEDGER.track() as d:
            getattr(api, name)(*a_ours, algorithm=algo)
        used = LEDGER.calls[-1].algorithm
        ref(name, comm, *a_ref)
        ok = all_ok(comm, all(torch.equal(o, e) for o, e in zip(outs, refs)))
        expect = traffic(name, used, n, comm.rank, numel, case.x.element_size() if case.x is not None else
                         torch.empty(0, dtype=dtype).element_size(), root,
                         local=shape(comm)[1] if used == "hierarchical" else None)   # k ranks per node
        formula_ok = all_ok(comm, (d.msgs_sent, d.bytes_sent) == expect)
        hs = core.handshake_enabled()
        core.set_handshake(False)      # time the algorithm, not the safety check (as bench.py does)
        a_t = case.args()[0]
        times = time_call(lambda: getattr(api, name)(*a_t, algorithm=algo), comm, args.iters)
        core.set_handshake(hs)
        med = statistics.median(times)
        busbw = case.bus_bytes() / med * bus_factor(name, n) / 1e9 if n > 1 else 0.0
        failures += (not ok) + (not formula_ok)
        table.add_row(algo, used, "[green]pass[/]" if ok else "[red]FAIL[/]", f"{d.bytes_sent:,}", f"{expect[1]:,}",
                      "[green]yes[/]" if formula_ok else "[red]NO[/]", str(d.msgs_sent), f"{med * 1e3:.3f}", f"{busbw:.3f}")
    ref_args, _ = case.args()
    ref_times = time_call(lambda: ref(name, comm, *ref_args), comm, args.iters)
    med = statistics.median(ref_times)
    table.add_row(f"built-in ({comm.backend})", "-", "-", "-", "-", "-", "-", f"{med * 1e3:.3f}",
                  f"{case.bus_bytes() / med * bus_factor(name, n) / 1e9:.3f}" if n > 1 else "0.000")
    print0(table)
    print0("busbw = algbw × nccl-tests' factor; algbw = S / time, S = the full buffer for gather/scatter-type ops.")
    if failures:
        fail(f"rank {comm.rank}: {failures} check(s) failed", code=1)


def main_all_to_all(argv=None) -> None:
    """Check both all-to-all algorithms (even and uneven splits) against the built-in, the ledger
    against traffic(), and time them interleaved with the built-in."""
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
            y, want = torch.empty(sum(outs) if outs else rows), torch.empty(sum(outs) if outs else rows)
            sides = {"ours": lambda: api.all_to_all_single(y, x, outs, ins, group=comm, algorithm=algo),
                     "ref": lambda: ref("all_to_all_single", comm, want, x, output_split_sizes=outs,
                                        input_split_sizes=ins)}
            with LEDGER.track() as d:
                sides["ours"]()
            sides["ref"]()
            exp = traffic("all_to_all_single", LEDGER.calls[-1].algorithm, n, r, rows, 4, splits=ins)
            ok, fok = torch.equal(y, want), (d.msgs_sent, d.bytes_sent) == exp
            bad += (not ok) + (not fok)
            times = {side: [] for side in sides}
            for _ in range(a.iters):                                      # interleaved
                for side, fn in sides.items():
                    times[side] += time_call(fn, comm, 1, warmup=0)
            mo, mr = statistics.median(times["ours"]), statistics.median(times["ref"])
            t.add_row(algo, label, "[green]pass[/]" if ok else "[red]FAIL[/]", f"{d.bytes_sent:,}",
                      "[green]yes[/]" if fok else "[red]NO[/]", f"{mo * 1e3:.3f}", f"{mr * 1e3:.3f}",
                      f"{rows * 4 / mo * (n - 1) / n / 1e9:.3f}" if n > 1 else "-")
    print0(t)
    print0("busbw = S / time × (N-1)/N, S = this rank's input. Timings include the handshake (the default).")
    if bad:
        raise SystemExit(f"rank {r}: {bad} check(s) failed")
