"""What the pipeline engine reports after each training step: DeepSpeed's progress line and the
tensorboard / csv_monitor sections (zero_from_scratch/engine/monitor.py, the ZeRO engine's writer).

    "steps_per_print": 10            rank 0: "steps: 10 loss: 2.3456 iter time (s): 0.512 samples/sec: 31.250"
    "tensorboard": {"enabled": true, "output_path": "runs/", "job_name": "pipe"}

The line is DeepSpeed's PipelineEngine.train_batch print; the monitor tags are DeepSpeed's
(Train/Samples/lr, loss_scale in fp16, train_loss = the step's mean loss, grad_norm,
samples_per_sec), x = global_samples. Every rank already holds the mean loss and the global norm
(the engine's status all-reduce), so reporting sends nothing. Cost: rank 0's file writes.
"""
from __future__ import annotations

import time

from primitives.log import print0
from zero_from_scratch.engine.comm import Comm
from zero_from_scratch.engine.monitor import Monitors


class _View:
    """The engine as Monitors.write_step reads it."""

    def __init__(self, engine):
        self.e = engine

    @property
    def global_steps(self):
        return self.e.global_steps

    def get_lr(self):
        return [g["lr"] for g in self.e.optimizer.param_groups]

    def fp16_enabled(self):
        return self.e.scaler is not None

    @property
    def loss_scaler(self):
        return type("Scale", (), {"loss_scale": self.e.loss_scale})()

    def get_global_grad_norm(self):
        return self.e.global_grad_norm


class StepReport:
    def __init__(self, engine):
        self.spp = engine.cfg.run.instruments.get("steps_per_print")
        mons = engine.cfg.run.monitor
        on = any(c.enabled for c in mons.values())
        self.monitors = Monitors(mons, Comm("primitives"), engine.cfg.run.train_batch_size) if on else None
        self.t0, self.view = time.perf_counter(), _View(engine)

    def after_step(self, engine, loss: float) -> None:
        now, dt = time.perf_counter(), time.perf_counter() - self.t0
        self.t0 = now
        if self.spp and engine.global_steps % self.spp == 0:
            tput = engine.cfg.run.train_batch_size / dt if dt > 0 else float("inf")
            print0(f"steps: {engine.global_steps} loss: {loss:0.4f} iter time (s): {dt:0.3f} samples/sec: {tput:0.3f}")
        if self.monitors is not None:
            self.monitors.write_step(self.view, loss)
