"""Chapter 09's pictures: the measured timeline of every pipeline schedule, one PNG each, and
the measured bubble per stage next to the formula (p−1)/(v·m+p−1).

    python -m figures.ch09_pipeline                              # p = 4, m = 8, every schedule
    python -m figures.ch09_pipeline --pp 2 --micro-batches 4 --schedules gpipe 1f1b

Each schedule trains a few steps of a balanced stack (identical MLP blocks, so every stage costs
the same, which the formula assumes) on p spawned ranks; the engine times every instruction of the
last step on every rank with time.perf_counter (one monotonic clock for all local processes).
Measured bubble = 1 − busy / span (pipeline_parallel/engine/draining.py::measure_bubbles); messages
and waits count as idle, so on a shared CPU it is a little above the formula. Cost: schedules ×
(warm-up + 1) steps of p processes.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

import torch
import torch.nn as nn
from rich.table import Table

from figures.common import ROOT, pyplot, save
from pipeline_parallel.engine.draining import measure_bubbles
from pipeline_parallel.engine.module import LayerSpec, PipelineModule
from pipeline_parallel.engine.ds_pipe import initialize
from pipeline_parallel.schedules import bubble_formula
from primitives.launch import spawn
from primitives.log import console


COLORS = {"fwd": "#4C72B0", "bwd": "#55A868", "recv_act": "#DDDDDD", "recv_grad": "#DDDDDD",
          "send_act": "#C44E52", "send_grad": "#C44E52", "reduce_tied": "#8172B2", "reduce_grads": "#8172B2",
          "step": "#CCB974"}


class MLPBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _mse(y, target):
    return ((y - target) ** 2).mean()


def _run(rank, world, schedule, v, m, dim, rows, steps):
    layers = [LayerSpec(MLPBlock, dim) for _ in range(2 * world * v)]
    pm = PipelineModule(layers, num_stages=world, loss_fn=_mse, partition_method="uniform", seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": m,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "pipeline": {"schedule": schedule, "virtual_stages": v}}
    engine, *_ = initialize(model=pm, config=cfg)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)) for _ in range(m)]
    for _ in range(steps):
        engine.train_batch(iter(batches))
    return engine.timeline


def machine() -> str:
    try:
        ds = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds = "absent"
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"deepspeed {ds}, gloo")


def draw(events_per_rank, title, name, labels=None, source="figures.ch09_pipeline"):
    """One row per rank (labels: its y-axis names, default "stage r"); saved as tutorials/img/<name>.png."""
    plt = pyplot()
    bubbles, span, t0 = measure_bubbles(events_per_rank)
    p = len(events_per_rank)
    fig, ax = plt.subplots(figsize=(12, 0.7 * p + 1.6))
    for r, ev in enumerate(events_per_rank):
        for kind, mb, chunk, a, b in ev:
            if b - a <= 0:
                continue
            ax.broken_barh([((a - t0) * 1e3, (b - a) * 1e3)], (p - 1 - r - 0.4, 0.8), color=COLORS.get(kind, "#999"),
                           edgecolor="white", linewidth=0.3)
            if kind in ("fwd", "bwd") and (b - a) / span > 0.02:
                ax.text((a + b - 2 * t0) / 2 * 1e3, p - 1 - r, f"{mb}" + (f".{chunk}" if chunk else ""),
                        ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p))
    labels = labels or [f"stage {r}" for r in range(p)]
    ax.set_yticklabels([f"{labels[r]}\nbubble {bubbles[r]:.0%}" for r in range(p)][::-1], fontsize=8)
    ax.set_xlabel("ms since the step began")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("fwd", "bwd", "recv_act", "send_act", "reduce_grads", "step")]
    ax.legend(handles, ["forward", "backward", "waiting for a receive", "posting a send", "tied/dp reduce", "optimizer step"],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 3 else -0.18), ncol=6, fontsize=7, frameon=False)
    return bubbles, save(fig, name, source, note="every instruction of the last step timed on every rank")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=2, help="for the interleaved schedule")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="the last one is drawn")
    ap.add_argument("--schedules", nargs="+", default=["naive", "gpipe", "1f1b", "interleaved"])
    a = ap.parse_args(argv if argv is not None else [])
    paths = []
    p, m = a.pp, a.micro_batches
    t = Table(title=f"measured bubble, p = {p}, m = {m} ({machine()})")
    for col in ("schedule", "v", "step ms", "bubble per stage (measured)", "max", "formula", "picture"):
        t.add_column(col)
    for s in a.schedules:
        v = a.virtual_stages if s == "interleaved" else 1
        events = spawn(_run, p, args=(s, v, m, a.dim, a.rows, a.steps), timeout=600)
        f = (p - 1) / p if s == "naive" else bubble_formula(p, m, v)
        bubbles, path = draw(events, f"{s} (v={v}), p={p} stages, m={m} micro-batches — formula bubble {f:.0%}",
                             f"09_timeline_{s}")
        paths.append(path)
        span = measure_bubbles(events)[1]
        t.add_row(s, str(v), f"{span * 1e3:.0f}", " ".join(f"{b:.2f}" for b in bubbles), f"{max(bubbles):.2f}",
                  f"{f:.2f}", os.path.relpath(path, ROOT))
    console.print(t)
    return paths


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
