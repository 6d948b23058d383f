"""Tensor parallelism: ours vs torch.distributed.tensor.parallel, and dp=4 vs dp=2×tp=2 vs tp=4.

    python benchmarks/tensor_parallel_bench.py                       # spawns its own ranks (gloo, CPU)
    python benchmarks/tensor_parallel_bench.py --quick               # smaller, for a smoke run

Part 1 (2 ranks): the same MLP blocks (Linear h→4h, GELU, Linear 4h→h) sharded column → row
by tensor_parallel.engine.parallelize and by torch's parallelize_module(ColwiseParallel,
RowwiseParallel) on init_device_mesh("cpu", (2,)); forward + backward on the same input,
interleaved, median of --iters. Ours runs with the default argument handshake and with it off.
Part 2 (4 ranks): one DistilBERT-shaped model as dp=4, dp=2 × tp=2 and tp=4, steps
interleaved in one run: step time (forward, backward, dp gradient all-reduce, AdamW), bytes
sent per rank per step (ledger), parameters held and saved-activation bytes per rank. Peak RSS
per rank (VmHWM, parity.zero.sides.peak_rss_bytes) needs each layout in processes of its
own, since VmHWM is per process and never falls: after the timed run, each layout runs
--rss-steps steps in 4 fresh ranks; printed whole (libraries included) and above the peak
reached once torch and transformers are imported (model, gradients, AdamW states, activations).
Timings come from a shared 2-core machine: compare ratios within one run, not absolutes.
(Named tensor_parallel_bench.py, not tensor_parallel.py: run by path, a file of the package's
name would be imported in its place.)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time


import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rich.table import Table

import primitives as P
import tensor_parallel as tp
from classification.parallel.memory import SavedBytes
from classification.parallel.train import _sync_dp
from primitives.launch import spawn
from primitives.engine.ledger import LEDGER
from primitives.log import console
from primitives.mesh import Mesh
from parity.zero.sides import peak_rss_bytes


def _mlp(h, blocks):
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)]
    return nn.Sequential(*layers)


def _vs_torch(rank, n, h, tokens, blocks, iters):
    torch.manual_seed(0)
    base = _mlp(h, blocks)
    ours = tp.parallelize(copy.deepcopy(base))
    theirs = parallelize_module(copy.deepcopy(base), init_device_mesh("cpu", (n,)),
                                {str(3 * i + j): (ColwiseParallel() if j == 0 else RowwiseParallel())
                                 for i in range(blocks) for j in (0, 2)})
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1))
    a, b = ours(x), theirs(x)
    diff = (a - b).abs().max().item()

    def step(m):
        m(x).sum().backward()
    sides = {"ours": lambda: step(ours), "ours, handshake off": lambda: step(ours), "torch TP": lambda: step(theirs)}
    times = {k: [] for k in sides}
    for i in range(iters + 1):
        for k, fn in sides.items():
            P.set_handshake(k != "ours, handshake off")
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i:                                         # the first round is warm-up
                times[k].append(time.perf_counter() - t0)
    P.set_handshake(True)
    return diff, {k: statistics.median(v) for k, v in times.items()}


LAYOUTS = {"dp=4": (4, 1), "dp=2 × tp=2": (2, 2), "tp=4": (1, 4)}


def _build(dp, tpn, dim, layers, b, s):
    """(model, optimizer, mesh, this replica's ids and labels) for one dp × tp layout."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification   # optional dependency
    cfg = DistilBertConfig(vocab_size=30522, dim=dim, n_heads=dim // 32, hidden_dim=4 * dim, n_layers=layers,
                           dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=2)
    cfg._attn_implementation = "eager"
    mesh = Mesh.build(dp=dp, tp=tpn)
    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(cfg)
    if tpn > 1:
        tp.parallelize(model, mesh.tp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    d = mesh.coords[1]
    g = torch.Generator().manual_seed(0)
    ids, lab = torch.randint(1, 30522, (b, s), generator=g), torch.randint(0, 2, (b,), generator=g)
    part = slice(d * b // dp, (d + 1) * b // dp)                   # this replica's share of the batch
    return model, opt, mesh, ids[part], lab[part]


def _step(model, opt, mesh, ids, lab, dp, saved=None):
    with LEDGER.track() as c:
        with saved if saved is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=lab).loss
        loss.backward()
        if dp > 1:
            _sync_dp(model, P.get_comm(mesh.dp_group))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return c.bytes_sent


def _configs(rank, n, dim, layers, b, s, iters):
    runs = {name: (*_build(dp, tpn, dim, layers, b, s), dp) for name, (dp, tpn) in LAYOUTS.items()}
    times, sent, acts = {k: [] for k in runs}, {}, {}
    for i in range(iters + 1):
        for name, (model, opt, mesh, ids, lab, dp) in runs.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            saved = SavedBytes(model)
            sent[name] = _step(model, opt, mesh, ids, lab, dp, saved)
            if i:
                times[name].append(time.perf_counter() - t0)
            acts[name] = saved.bytes
    return {k: (statistics.median(times[k]), sent[k], sum(p.numel() for p in runs[k][0].parameters()), acts[k])
            for k in runs}


def _peak_rss(rank, n, name, dim, layers, b, s, steps):
    """VmHWM of this rank after `steps` training steps of one layout, alone in its process."""
    import transformers  # noqa: F401  (imported before the baseline, like every rank's libraries)
    dp, tpn = LAYOUTS[name]
    before = peak_rss_bytes()
    model, opt, mesh, ids, lab = _build(dp, tpn, dim, layers, b, s)
    for _ in range(steps):
        _step(model, opt, mesh, ids, lab, dp)
    return peak_rss_bytes(), before


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--rss-steps", type=int, default=3, help="steps per layout in the peak-RSS processes")
    a = ap.parse_args(argv)
    iters = a.iters or (3 if a.quick else 10)
    h, tokens, blocks = (256, 256, 2) if a.quick else (512, 1024, 2)
    diff, med = spawn(_vs_torch, 2, args=(h, tokens, blocks, iters), timeout=900)[0]
    t = Table(title=f"MLP column→row, 2 ranks, {blocks} blocks h={h} (4h inside), {tokens} tokens, fp32: "
                    f"forward + backward (median of {iters}, interleaved; max |ours − torch| = {diff:.1e})")
    for c in ("implementation", "ms / step", "vs torch TP"):
        t.add_column(c, justify="right")
    for k, v in med.items():
        t.add_row(k, f"{v * 1e3:.1f}", f"{v / med['torch TP']:.2f}×")
    console.print(t)
    dim, layers, b, s = (128, 2, 8, 32) if a.quick else (256, 4, 16, 64)
    res = spawn(_configs, 4, args=(dim, layers, b, s, iters), timeout=1800)
    rss = {k: spawn(_peak_rss, 4, args=(k, dim, layers, b, s, a.rss_steps), timeout=900) for k in LAYOUTS}
    t = Table(title=f"DistilBERT shape dim={dim}, {layers} layers, batch {b} × {s} tokens in total, 4 ranks: "
                    f"step time rank 0 (median of {iters}, interleaved), per-rank bytes and memory; peak RSS = "
                    f"VmHWM per rank, each layout in fresh processes ({a.rss_steps} steps)")
    for c in ("layout", "ms / step", "vs dp=4", "bytes sent / step (rank 0)", "params held (rank 0)",
              "saved activations MiB (rank 0)", "peak RSS MiB (ranks 0-3)", "above imports MiB (ranks 0-3)"):
        t.add_column(c, justify="right")
    base = res[0]["dp=4"][0]
    for k, (sec, nbytes, params, act) in res[0].items():
        t.add_row(k, f"{sec * 1e3:.0f}", f"{sec / base:.2f}×", f"{nbytes:,}", f"{params:,}", f"{act / 2**20:.1f}",
                  " ".join(f"{r / 2**20:.0f}" for r, _ in rss[k]), " ".join(f"{(r - b0) / 2**20:.0f}" for r, b0 in rss[k]))
    console.print(t)
    console.print(f"machine: {os.cpu_count()} cores (shared), torch {torch.__version__}, gloo; ours = ringzero "
                  "collectives (auto algorithm), torch TP = DTensor functional collectives on gloo.")


if __name__ == "__main__":
    main()
