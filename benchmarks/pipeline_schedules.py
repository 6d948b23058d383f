"""Pipeline schedules vs DeepSpeed's pipeline engine: step time and stored activations, one run.

    python benchmarks/pipeline_schedules.py                       # pp = 2, m = 8 (= 4p), 6 rounds
    python benchmarks/pipeline_schedules.py --pp 4 --micro-batches 16 --rounds 4

All engines live in the same pp spawned processes (gloo, 1 thread each), built from the same
GPT-style layer list (pipeline_parallel/engine/model.py) and fed the same micro-batches; the timed steps
are interleaved round-robin (naive, gpipe, 1f1b, interleaved, deepspeed, naive, …) after one
warm-up step each, with a barrier before every step, so machine noise hits every side alike.
Reported: median and min–max step time, the ratio to DeepSpeed's median, and the peak bytes
autograd keeps for backward (activations; parameters excluded), measured the same way for every
engine: saved_tensors_hooks count a tensor when it is saved and a weakref finaliser uncounts it
when autograd frees it. Peak RSS per engine is not reported: the engines share processes (that
is what makes the timing fair), so one process's RSS mixes them.
"""
from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
import torch.distributed as dist
from rich.table import Table

from figures.ch09_pipeline import machine
from pipeline_parallel.engine.model import gpt_layers, lm_loss
from pipeline_parallel.engine.module import PipelineModule
from pipeline_parallel.engine.ds_pipe import initialize
from pipeline_parallel.engine.deepspeed_engine import deepspeed_engine
from primitives.launch import spawn
from primitives.log import console

SIDES = ("naive", "gpipe", "1f1b", "interleaved", "deepspeed")


class SavedBytes:
    """Live and peak bytes of tensors autograd saved for backward, excluding parameters."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def _pack(self, t):
        if t.untyped_storage().data_ptr() in self.params:
            return t
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n):
        self.live -= n

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def _worker(rank, world, a):
    layers = gpt_layers(vocab=256, dim=a.dim, n_layers=a.layers, heads=4, max_len=a.seq)
    base = {"train_micro_batch_size_per_gpu": a.micro_batch_size, "gradient_accumulation_steps": a.micro_batches,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10 ** 9}
    engines, params = {}, {}
    for s in SIDES[:-1]:
        v = 2 if s == "interleaved" else 1
        pm = PipelineModule(layers, num_stages=world, loss_fn=lm_loss, seed_layers=True)
        eng, *_ = initialize(model=pm, config={**base, "pipeline": {"schedule": s, "virtual_stages": v}})
        eng.measure_activations = False         # the one SavedBytes meter below measures every engine
        engines[s], params[s] = eng, eng.params
    ds, net = deepspeed_engine(layers, world, lm_loss, base)
    engines["deepspeed"], params["deepspeed"] = ds, [p for p in net.parameters()]
    g = torch.Generator().manual_seed(rank // world)
    data = [(torch.randint(0, 256, (a.micro_batch_size, a.seq), generator=g),
             torch.randint(0, 256, (a.micro_batch_size, a.seq), generator=g)) for _ in range(a.micro_batches)]
    times = {s: [] for s in SIDES}
    peaks = {s: 0 for s in SIDES}
    for r in range(a.rounds + 1):
        for s in SIDES:
            meter = SavedBytes(params[s])
            dist.barrier()
            t = time.perf_counter()
            with meter():
                engines[s].train_batch(data_iter=iter(data))
            dist.barrier()
            if r:                                   # round 0 is the warm-up
                times[s].append(time.perf_counter() - t)
            peaks[s] = max(peaks[s], meter.peak)
    return {"times": times, "peaks": peaks}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args(argv)
    out = spawn(_worker, a.pp, args=(a,), timeout=1200)
    # a step ends when its slowest rank ends: the barrier makes every rank's time that
    step = {s: [max(o["times"][s][i] for o in out) for i in range(a.rounds)] for s in SIDES}
    ds_med = statistics.median(step["deepspeed"])
    ds_peak = max(o["peaks"]["deepspeed"] for o in out)
    gp_peak = max(o["peaks"]["gpipe"] for o in out)
    t = Table(title=f"pp={a.pp}, m={a.micro_batches}, micro-batch {a.micro_batch_size}×{a.seq}, dim {a.dim}, "
                    f"{a.layers} blocks, {a.rounds} interleaved rounds — {machine()}")
    for col in ("engine", "step s (median)", "min–max", "× DeepSpeed", "peak saved activations (max over ranks)",
                "× GPipe", "× DeepSpeed "):
        t.add_column(col)
    for s in SIDES:
        med = statistics.median(step[s])
        peak = max(o["peaks"][s] for o in out)
        t.add_row(s if s == "deepspeed" else f"ours {s}", f"{med:.3f}", f"{min(step[s]):.3f}–{max(step[s]):.3f}",
                  f"{med / ds_med:.2f}", f"{peak / 2 ** 20:.2f} MiB", f"{peak / gp_peak:.2f}", f"{peak / ds_peak:.2f}")
    console.print(t)


if __name__ == "__main__":
    main()
