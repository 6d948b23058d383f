"""The ranks' side of benchmarks/multinode.py: run under torchrun on every rank of the namespaced cluster.

    python -m benchmarks.multinode            (starts these workers; needs root)
    torchrun --nnodes 2 --nproc_per_node 2 ... -m benchmarks.multinode_worker --worker OUT.json --sizes 1,4 --reps 3

worker(): fits α, β per link class with a gloo ping-pong, then times all-reduce / all-gather /
reduce-scatter with algorithm="ring", "hierarchical" and torch.distributed's built-in, interleaved
call by call, a barrier before each; rank 0 writes the times. zero_worker(): ZeRO-3 vs ZeRO-3 + hpZ
(k = ranks per node), steps interleaved, with the inter-node bytes the ledger counted.
Cost: --reps × (every size × 3 algorithms) collectives; the ping-pong sends 8 B to 4 MiB.
"""
from __future__ import annotations

import os
import sys

if not __package__:   # run by path: this folder (and its multinode.py) would hide the multinode package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import primitives as P
import zero_from_scratch
from multinode.pingpong import fit
from primitives.launch import init_from_env
from primitives.engine.ledger import LEDGER

ALGOS = ("ring", "hierarchical", "built-in")
MIB = 1 << 20


def _pingpong(comm, peer, sizes, reps):
    pts = []
    for s in sizes:
        buf = torch.zeros(max(1, s // 4))
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, peer)
                comm.recv(buf, peer)
            else:
                comm.recv(buf, 0)
                comm.send(buf, 0)
            ts.append((time.perf_counter() - t0) / 2)
        pts.append((buf.numel() * 4, min(ts[1:])))
    return pts


def worker(args) -> None:
    comm = init_from_env("gloo", timeout=300)
    n, r = comm.size, comm.rank
    res = {"world": n, "local": comm.intra_node().size, "nodes": comm.inter_node().size}
    sizes_pp = [8, 64 << 10, MIB, 4 * MIB]
    for link, peer in (("intra", 1), ("inter", res["local"])):     # rank 0 <-> 1 share a node; 0 <-> k do not
        pts = None
        if r in (0, peer):
            pts = _pingpong(comm, peer if r == 0 else 0, sizes_pp, 3)
        dist.barrier()
        if r == 0:
            res[link] = fit(pts)
    x = torch.zeros(8 * MIB // 4)
    t0 = time.perf_counter()
    for _ in range(3):
        x.add_(x)
    res["gamma"] = (time.perf_counter() - t0) / 3 / x.numel() / 4

    def one(name, algo, nbytes):
        numel = nbytes // 4
        if name == "all_reduce":
            t = torch.zeros(numel)
            call = (lambda: dist.all_reduce(t)) if algo == "built-in" else (lambda: P.all_reduce(t, algorithm=algo))
        elif name == "all_gather":
            inp, out = torch.zeros(numel // n), torch.zeros(numel // n * n)
            call = ((lambda: dist.all_gather_into_tensor(out, inp)) if algo == "built-in"
                    else (lambda: P.all_gather_single(out, inp, algorithm=algo)))
        else:
            inp, out = torch.zeros(numel // n * n), torch.zeros(numel // n)
            call = ((lambda: dist.reduce_scatter_tensor(out, inp)) if algo == "built-in"
                    else (lambda: P.reduce_scatter_single(out, inp, algorithm=algo)))
        dist.barrier()
        t0 = time.perf_counter()
        call()
        el = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(el, op=dist.ReduceOp.MAX)        # the slowest rank decides
        return el.item()

    cases = [("all_reduce", int(s * MIB)) for s in args.sizes]
    cases += [(nm, int(max(args.sizes) * MIB)) for nm in ("all_gather", "reduce_scatter")]
    times = {f"{nm}|{s}|{a}": [] for nm, s in cases for a in ALGOS}
    for nm, s in cases:                                   # warm-up: connections, scratch buffers
        for a in ALGOS:
            one(nm, a, s)
    for rep in range(args.reps):
        for nm, s in cases:
            order = ALGOS[rep % 3:] + ALGOS[:rep % 3]     # rotate who goes first
            for a in order:
                times[f"{nm}|{s}|{a}"].append(one(nm, a, s))
    res["times"] = times
    if r == 0:
        with open(args.worker, "w") as f:
            json.dump(res, f)


def zero_worker(args) -> None:
    """ZeRO-3 vs ZeRO-3 + hpZ (k = ranks per node), same model and data, steps interleaved."""
    comm = init_from_env("gloo", timeout=600)
    k = comm.intra_node().size
    engines = {}
    for name, hpz in (("zero3", 1), ("zero3+hpZ", k)):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(1024, 1024), nn.Tanh())], nn.Linear(1024, 16))
        cfg = {"train_micro_batch_size_per_gpu": 32, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz}}
        engines[name] = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    times = {n: [] for n in engines}
    inter = {n: 0 for n in engines}
    for step in range(args.reps + 1):
        g = torch.Generator().manual_seed(step * 100 + comm.rank)
        x, y = torch.randn(32, 1024, generator=g), torch.randint(0, 16, (32,), generator=g)
        for name, eng in engines.items():
            dist.barrier()
            LEDGER.reset()
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(eng(x), y)
            eng.backward(loss)
            eng.step()
            el = torch.tensor([time.perf_counter() - t0])
            mine = torch.tensor([float(LEDGER.links["inter"].bytes_sent if "inter" in LEDGER.links else 0)])
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
            dist.all_reduce(mine)
            if step:                                      # step 0 is the warm-up
                times[name].append(el.item())
                inter[name] = mine.item() / comm.inter_node().size   # bytes one node sends across
    if comm.rank == 0:
        with open(args.zero_worker, "w") as f:
            json.dump({"times": times, "inter_bytes_per_node": inter, "k": k, "world": comm.size,
                       "params": sum(u.numel for u in engines["zero3"].layout.units)}, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help="collectives: rank 0 writes the times here")
    ap.add_argument("--zero-worker", default=None, help="ZeRO-3 vs hpZ: rank 0 writes the times here")
    ap.add_argument("--sizes", default="0.25,1,4,8", help="all-reduce sizes in MiB")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    a.sizes = [float(x) for x in a.sizes.split(",")]
    if a.worker:
        worker(a)
    if a.zero_worker:
        zero_worker(a)
