"""The measuring half of benchmarks/one_host.py: every all-reduce contender on the same ranks,
size after size, interleaved, written as JSON rows (rank 0). one_host.py launches it:

    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 2 python -m benchmarks.one_host_worker --launcher mpiexec --json out.json
    torchrun --standalone --nproc_per_node 2 -m benchmarks.one_host_worker --launcher torchrun --json out.json

Contenders, on one buffer of zeros per size (repeated in-place sums of zeros stay zeros):
  default          P.all_reduce(t): what a user gets (check on, transport auto, algorithm auto)
  unchecked        the same with set_handshake(False)
  gloo, mpich      the built-ins (mpich only under mpiexec: one job holds MPI's world and gloo's)
  memcpy           every rank copies S bytes at once (the memory ceiling, same size, same ranks)
  <tp>/<algo>      every all-reduce algorithm, unchecked, on transport tp = shm (this host's
                   shared memory) and tcp (gloo's TCP): the measurements the cost model is fitted to
and, with --ops all_reduce,all_gather_single, every all-gather algorithm the same way (an
all-gather reduces nothing: beside the all-reduces it tells the fit β from γ).
Each of `reps` rounds times every contender in turn, every other round in reverse order, so no
contender is always timed first (iterations sized to ~budget seconds, at least one); a sample is
the slowest rank's mean per call. The check's own cost: checked_alt / unchecked_alt, the default
call with the check on and off in turn, call by call (alternating(): per-call medians); switching
keeps each setting's planned calls (primitives/engine/planned.py), so neither side re-plans.
Cost: ~20 contenders × sizes × reps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import primitives as P
from primitives.launch import free_port

SKIP = {"hierarchical"}      # one host: the hierarchy is the plain ring (cost.py)


def worlds(launcher: str, timeout: float):
    """(MPI module or None, MPI world or None) with gloo's default group up on the same ranks."""
    if launcher != "mpiexec":
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        return None, None
    from mpi4py import MPI   # optional dependency: only the mpiexec launch has an MPICH contender
    w = MPI.COMM_WORLD
    port = w.bcast(free_port() if w.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=w.rank, world_size=w.size,
                            timeout=timedelta(seconds=timeout))
    return MPI, w


def tcp_group():
    """A second gloo group on the same ranks whose communicator runs on TCP (RINGZERO_TRANSPORT
    is read when a group's communicator is built: set for this one build only)."""
    g = dist.new_group(backend="gloo")
    old = os.environ.get("RINGZERO_TRANSPORT")
    os.environ["RINGZERO_TRANSPORT"] = "tcp"
    try:
        P.get_comm(g)
    finally:
        os.environ.pop("RINGZERO_TRANSPORT") if old is None else os.environ.__setitem__("RINGZERO_TRANSPORT", old)
    return g


def contenders(op: str, S: int, n: int, MPI, w, tcp):
    """name -> (zero-argument call, handshake on?), on float32 zeros of S bytes (the full buffer)."""
    out = {}
    if op == "all_reduce":
        buf, src, dst = torch.zeros(S // 4), torch.zeros(S // 4), torch.zeros(S // 4)
        run = lambda g, al: P.all_reduce(buf, group=g, algorithm=al)  # noqa: E731
        out = {"default": (lambda: P.all_reduce(buf), True), "unchecked": (lambda: P.all_reduce(buf), False),
               "gloo": (lambda: dist.all_reduce(buf), True), "memcpy": (lambda: dst.copy_(src), True)}
        if w is not None:
            out["mpich"] = (lambda: w.Allreduce(MPI.IN_PLACE, buf.numpy()), True)
    else:
        o, i = torch.zeros(S // 4), torch.zeros(S // 4 // n)
        run = lambda g, al: P.all_gather_single(o, i, group=g, algorithm=al)  # noqa: E731
    for tp, group in (("shm", None), ("tcp", tcp)):
        for al in P.algorithms_for(op, P.get_comm(group)):
            if al not in SKIP:
                out[f"{tp}/{al}"] = ((lambda g=group, al=al: run(g, al)), False)
    return out


def slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn, handshake: bool, iters: int) -> float:
    P.set_handshake(handshake)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return slowest((time.perf_counter() - t0) / iters)
    finally:
        P.set_handshake(True)


def alternating(fn, iters: int) -> tuple[float, float]:
    """(checked, unchecked): the median seconds of fn's calls with the check on and off, one call of
    each in turn, each timed alone (the slowest rank's median). A median of single calls drops the
    calls a loaded machine descheduled, which a mean over a 30 ms window keeps: it resolves the
    check's ~1 µs where two windows' means differ by 2× at load 12."""
    ts = {True: [], False: []}
    dist.barrier()
    try:
        for i in range(2 * iters):
            P.set_handshake(i % 2 == 0)            # every rank switches at the same call
            t0 = time.perf_counter()
            fn()
            ts[i % 2 == 0].append(time.perf_counter() - t0)
    finally:
        P.set_handshake(True)
    return slowest(statistics.median(ts[True])), slowest(statistics.median(ts[False]))


def measure(ops, sizes, reps: int, budget: float, MPI, w, tcp) -> list[dict]:
    n, rows = dist.get_world_size(), []
    for op in ops:
        for S in sizes:
            fns = contenders(op, S, n, MPI, w, tcp)
            iters, ran = {}, {}
            for k, (fn, hs) in fns.items():              # warm up, then size the iterations
                timed(fn, hs, 2)
                iters[k] = max(1, min(200, int(budget / max(timed(fn, hs, 1), 1e-7))))
                if k in ("default", "unchecked"):
                    ran[k] = P.LEDGER.calls[-1].algorithm if P.LEDGER.calls else "?"
            samples = {k: [] for k in [*fns, *(["checked_alt", "unchecked_alt"] if "default" in fns else [])]}
            order = list(fns)
            for rep in range(reps):      # every other rep backwards: no contender is always timed first
                for k in (order if rep % 2 == 0 else order[::-1]):
                    samples[k].append(timed(*fns[k], iters[k]))
                if "default" in fns:
                    for k, t in zip(("checked_alt", "unchecked_alt"), alternating(fns["default"][0], iters["default"])):
                        samples[k].append(t)
            P.LEDGER.calls.clear()
            for k, ts in samples.items():
                tp, _, al = k.partition("/")
                rows.append(dict(op=op, n=n, size=S, name=k, transport=tp if al else "", algo=al or ran.get(k, ""),
                                 samples=ts, iters=iters.get(k, iters.get("default"))))
            del fns
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launcher", choices=("mpiexec", "torchrun"), default="torchrun")
    ap.add_argument("--sizes", required=True, help="comma list of bytes")
    ap.add_argument("--ops", default="all_reduce,all_gather_single")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.03, help="seconds per sample (iterations sized to it)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    MPI, w = worlds(a.launcher, a.timeout)
    P.get_comm()                              # the default group's communicator: transport auto
    tcp = tcp_group()
    P.LEDGER.keep_calls = True
    rows = measure(a.ops.split(","), [int(s) for s in a.sizes.split(",")], a.reps, a.budget, MPI, w, tcp)
    if dist.get_rank() == 0:
        info = dict(transport=P.get_comm().transport, torch=torch.__version__, cores=os.cpu_count(),
                    mpich=MPI.Get_library_version().split("\n")[0] if MPI else None, load=os.getloadavg()[0],
                    heavy_yield=os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "unset"))
        with open(a.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
