"""Activation checkpointing on vs off: peak memory of one forward+backward, and its time.

    python benchmarks/activation_checkpointing.py            # DistilBERT dim 384, 6 layers, batch 16 × seq 256
    python benchmarks/activation_checkpointing.py --quick    # dim 64, 2 layers: proves it runs

Each setting runs in a fresh process (primitives spawn, world size 1, our engine at ZeRO-0 so the
engine's path is the one measured), interleaved off/on per repeat. Activation memory = peak RSS
(VmHWM) during the training step minus the RSS just before it (model, grads and optimizer states
are allocated before: one warm-up step runs first and the high-water mark is then reset through
/proc/self/clear_refs). Expected: off keeps every layer's activations (~layers × per-layer), on
keeps each layer's input plus one layer's activations during its recompute; on costs one extra
forward (≈ +1/3 of a step). Machine: 2 shared cores, so times are indicative only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


import torch  # noqa: E402
import zero_from_scratch
from rich.table import Table
from primitives.log import console
from primitives.launch import spawn

MIB = 2 ** 20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return -1


def _run(rank, world, on, dim, layers, bs, seq):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification  # optional dependency
    torch.manual_seed(0)
    m = DistilBertForSequenceClassification(DistilBertConfig(dim=dim, n_layers=layers, n_heads=max(2, dim // 64),
                                                             hidden_dim=4 * dim, dropout=0.0, attention_dropout=0.0))
    cfg = {"train_micro_batch_size_per_gpu": bs, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if on:
        cfg["activation_checkpointing"] = {}
    engine, *_ = zero_from_scratch.initialize(model=m, config=cfg)
    g = torch.Generator().manual_seed(0)
    x = {"input_ids": torch.randint(1, 30000, (bs, seq), generator=g), "labels": torch.randint(0, 2, (bs,), generator=g)}
    times = []
    for i in range(3):
        if i == 1:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                           # reset VmHWM to the current RSS
            base = _status("VmRSS:")
        t = time.perf_counter()
        engine.backward(engine(**x).loss)
        engine.step()
        times.append(time.perf_counter() - t)
    return {"act": _status("VmHWM:") - base, "step_s": statistics.median(times[1:])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)

    shape = (64, 2, 4, 64) if a.quick else (384, 6, 16, 256)
    rows = {False: [], True: []}
    for _ in range(a.repeats):
        for on in (False, True):
            rows[on].append(spawn(_run, 1, timeout=1200.0, args=(on, *shape))[0])
    t = Table(title=f"DistilBERT dim {shape[0]}, {shape[1]} layers, batch {shape[2]} × seq {shape[3]}: one training step, "
                    f"{torch.__version__}, 2 shared cores")
    for c in ("activation checkpointing", "activation memory (MiB, min..max)", "step s (median)"):
        t.add_column(c, justify="right")
    for on, rs in rows.items():
        acts = [r["act"] / MIB for r in rs]
        t.add_row("on" if on else "off", f"{min(acts):,.0f}..{max(acts):,.0f}",
                  f"{statistics.median(r['step_s'] for r in rs):.2f}")
    console.print(t)
    off, on = (statistics.median(r["act"] for r in rows[k]) for k in (False, True))
    ts = [statistics.median(r["step_s"] for r in rows[k]) for k in (False, True)]
    console.print(f"activation memory on / off = {on / off:.2f}; step time on / off = {ts[1] / ts[0]:.2f}")


if __name__ == "__main__":
    main()
