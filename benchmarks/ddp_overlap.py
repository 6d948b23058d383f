"""Does overlapping communication with backward pay off? Chapter 4 vs torch DDP vs chapter 3.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/ddp_overlap.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/ddp_overlap.py --json out.json

Every rank builds the same MLP (default 256 → 5 × 1024 → 16: Ψ ≈ 4.5 M parameters, 17 MiB of fp32
gradients, so a step's ring all-reduce sends 2(N−1)/N·Ψ·4 ≈ 17 MiB per rank at N = 2; batch 128
per rank so that backward lasts about as long as the all-reduce) once per contender:

    local      no communication at all: the compute-only floor
    flat       chapter 3, one all-reduce of the whole gradient after backward (no overlap)
    bucketed   chapter 4, buckets all-reduced during backward (our ring, primitives)
    ddp        chapter 5, torch DistributedDataParallel (gloo's all-reduce), same bucket cap

The contenders are interleaved step by step (a barrier before each timed step), so machine
noise hits all of them alike; we report the median and min–max over the timed steps, the
ratios bucketed/ddp and flat/bucketed, and "exposed communication" = median − local median:
the part of the all-reduce that backward did not hide. The primitives' per-call metadata
handshake is off by default (--handshake turns it on), since torch's all-reduce has none.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

import primitives as P
from ddp_examples.engine.common import Config, build_model
from ddp_examples.engine.wrappers import BucketedDataParallel, FlatDataParallel
from primitives.launch import init_from_env
from primitives.log import print0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in-dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    ap.add_argument("--bucket-cap-mb", type=float, default=4.5,
                    help="chapter 4 and DDP alike; 4.5 puts each 4 MiB weight with its neighbours' biases")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--handshake", action="store_true", help="keep primitives' per-call argument handshake")
    ap.add_argument("--json", default=None, help="write the figures to this file (rank 0)")
    a = ap.parse_args(argv)

    comm = init_from_env("gloo")
    if comm.size < 2:
        raise SystemExit("run under torchrun --nproc_per_node 2 (a world of 1 has nothing to overlap)")
    P.set_handshake(a.handshake)
    P.LEDGER.keep_calls = False
    torch.manual_seed(1234 + comm.rank)
    cfg = Config(in_dim=a.in_dim, hidden=a.hidden, depth=a.depth, classes=16, global_batch=a.batch * comm.size)
    models = {
        "local": build_model(cfg),
        "flat": FlatDataParallel(build_model(cfg)),
        "bucketed": BucketedDataParallel(build_model(cfg), bucket_cap_mb=a.bucket_cap_mb),
        "ddp": DistributedDataParallel(build_model(cfg), bucket_cap_mb=a.bucket_cap_mb),
    }
    psi = sum(p.numel() for p in models["local"].parameters())
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = torch.randn(a.batch, cfg.in_dim)
    y = torch.randint(0, cfg.classes, (a.batch,))
    times = {k: [] for k in models}

    def step(name):
        m, opt = models[name], opts[name]
        dist.barrier()                        # start together; not timed
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(m(x), y).backward()
        if hasattr(m, "sync_gradients"):
            m.sync_gradients()
        opt.step()
        return time.perf_counter() - t0

    for i in range(a.warmup + a.steps):
        for name in models:                   # interleaved: one step of each, in turn
            t = step(name)
            if i >= a.warmup:
                times[name].append(t)

    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"world_size": comm.size, "params": psi, "grad_mb": psi * 4 / 2 ** 20,
           "bucket_cap_mb": a.bucket_cap_mb, "buckets": len(models["bucketed"].buckets),
           "batch_per_rank": a.batch, "steps": a.steps, "handshake": a.handshake,
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "median_ms": {k: v * 1e3 for k, v in med.items()},
           "min_ms": {k: min(v) * 1e3 for k, v in times.items()},
           "max_ms": {k: max(v) * 1e3 for k, v in times.items()},
           "ratio_bucketed_over_ddp": med["bucketed"] / med["ddp"],
           "ratio_flat_over_bucketed": med["flat"] / med["bucketed"]}
    t = Table(title=f"Ψ = {psi:,} ({out['grad_mb']:.1f} MiB fp32), {comm.size} ranks, batch {a.batch}/rank, "
                    f"{out['buckets']} buckets of ≤ {a.bucket_cap_mb} MiB, {a.steps} interleaved steps")
    for c in ("contender", "median ms", "min–max ms", "× ddp", "exposed comm ms"):
        t.add_column(c, justify="left" if c == "contender" else "right")
    label = {"local": "local (no communication)", "flat": "ch3 flat, after backward",
             "bucketed": "ch4 bucketed, overlapped", "ddp": "ch5 torch DDP"}
    for k in models:
        t.add_row(label[k], f"{med[k] * 1e3:.1f}", f"{min(times[k]) * 1e3:.1f}–{max(times[k]) * 1e3:.1f}",
                  f"{med[k] / med['ddp']:.2f}", "—" if k == "local" else f"{(med[k] - med['local']) * 1e3:.1f}")
    print0(t)
    print0(f"bucketed / ddp = {out['ratio_bucketed_over_ddp']:.2f}   "
           f"flat / bucketed = {out['ratio_flat_over_bucketed']:.2f}   (handshake {'on' if a.handshake else 'off'})")
    if a.json and comm.rank == 0:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
