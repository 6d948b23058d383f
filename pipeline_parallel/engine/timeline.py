"""Measured schedule timelines and bubbles: every instruction of a step timed on every rank.

    python -m figures.ch09_pipeline                              # p = 4, m = 8, every schedule: PNGs + table
    python -m figures.ch09_pipeline --pp 2 --micro-batches 4 --schedules gpipe 1f1b

Each schedule trains a few steps of a balanced stack (identical MLP blocks, so every stage costs
the same, which the formula assumes) on p spawned ranks; every rank times every instruction of
the last step with time.perf_counter (one monotonic clock for all local processes). Per rank:
busy = Σ forward + backward time; the step's span runs from the first instruction on any rank to
the last compute on any rank; measured bubble = 1 − busy / span, set next to (p−1)/(v·m+p−1)
(naive: (p−1)/p). Messages and waits count as idle, so on a shared CPU the measured bubble is a
little above the formula. Cost: schedules × (warm-up + 1) steps of p processes.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform

import torch
import torch.nn as nn

from pipeline_parallel.engine.module import LayerSpec, PipelineModule
from pipeline_parallel.engine.pipe_engine import initialize

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


def measure(events_per_rank):
    """(bubble per rank, span, t0): busy = forward + backward time."""
    t0 = min(e[3] for ev in events_per_rank for e in ev)
    t1 = max(e[4] for ev in events_per_rank for e in ev if e[0] in ("fwd", "bwd"))
    busy = [sum(e[4] - e[3] for e in ev if e[0] in ("fwd", "bwd")) for ev in events_per_rank]
    return [1 - b / (t1 - t0) for b in busy], t1 - t0, t0


def machine() -> str:
    try:
        ds = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds = "absent"
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"deepspeed {ds}, gloo")
