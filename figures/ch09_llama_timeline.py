"""Chapter 09's llama picture: the measured 1F1B timeline of transformers' llama cut into pipeline layers.

    python -m figures.ch09_llama_timeline                        # pp=2, and pp=2 × dp=2 (4 ranks)
    python -m figures.ch09_llama_timeline --shapes 2x1 --preset small --micro-batches 8

pipeline_parallel.models.llama_layers(model) (embedding, decoder blocks, final norm, LM head) in our
PipelineModule (partition "parameters"), 1F1B over m micro-batches of b sequences, on spawned ranks; every
instruction of the last step timed on every rank by the engine's recorder
(engine.timeline: pipeline_parallel/engine/draining.py) and drawn by figures/ch09_pipeline.py::draw.
With dp = 2 each stage's gradients are all-reduced over its replica pair after the last backward
(the "tied/dp reduce" bars). On a shared CPU the waits include other jobs' time slices: the picture
shows the schedule's shape, its bubble numbers sit above the formula (p−1)/(m+p−1).
Cost: one spawn per shape, warm-up + 1 steps of pp × dp processes.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from rich.table import Table

from figures.ch09_pipeline import draw, machine
from figures.common import ROOT
from pipeline_parallel.engine.module import PipelineModule
from pipeline_parallel.engine.ds_pipe import initialize
from pipeline_parallel.engine.draining import measure_bubbles
from pipeline_parallel.models import llama_layers, llama_loss, llama_model
from pipeline_parallel.schedules import bubble_formula
from primitives.launch import spawn
from primitives.log import console


def _layer_names(model) -> list[str]:
    n = model.config.num_hidden_layers
    return ["embed"] + [f"block {i}" for i in range(n)] + ["norm", "head"]


def _run(rank, world, pp, preset, m, b, seq, steps):
    """(timeline of the last step, stage, dp rank, this stage's layers) on one rank."""
    model = llama_model(preset).train()
    pm = PipelineModule(llama_layers(model), num_stages=pp, loss_fn=llama_loss)
    cfg = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = initialize(model=pm, config=cfg)
    g = torch.Generator().manual_seed(engine.dp_rank)            # each data replica reads its own batches
    ids = [torch.randint(0, model.config.vocab_size, (b, seq), generator=g) for _ in range(m)]
    for _ in range(steps):
        engine.train_batch(iter([(x, x.clone()) for x in ids]))
    lo, hi = pm.parts[engine.stage], pm.parts[engine.stage + 1]
    names = _layer_names(model)[lo:hi]
    return engine.timeline, engine.stage, engine.dp_rank, f"{names[0]} … {names[-1]}" if len(names) > 1 else names[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["2x1", "2x2"], help="pp x dp")
    ap.add_argument("--preset", default="tiny", help="pipeline_parallel.models.PRESETS (small: ~6M parameters)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="the last one is drawn")
    a = ap.parse_args(argv if argv is not None else [])
    m, paths = a.micro_batches, []
    t = Table(title=f"llama {a.preset}, 1F1B, m = {m} micro-batches of {a.micro_batch_size}×{a.seq} tokens ({machine()})")
    for col in ("pp × dp", "rank: stage/replica, layers", "step ms", "bubble per rank (measured)", "formula", "picture"):
        t.add_column(col)
    for shape in a.shapes:
        pp, dp = (int(x) for x in shape.split("x"))
        out = spawn(_run, pp * dp, args=(pp, a.preset, m, a.micro_batch_size, a.seq, a.steps), timeout=900)
        out = sorted(out, key=lambda o: (o[1], o[2]))                  # stage-major rows: stage 0's replicas first
        labels = [f"stage {s}" + (f" / dp {d}" if dp > 1 else "") + f"\n{names}" for _, s, d, names in out]
        f = bubble_formula(pp, m, 1)
        bubbles, path = draw([o[0] for o in out], f"llama {a.preset} in pipeline layers, 1F1B, pp={pp} × dp={dp}, "
                             f"m={m} — formula bubble {f:.0%}", f"09_llama_timeline_pp{pp}_dp{dp}",
                             labels=labels, source="figures.ch09_llama_timeline")
        paths.append(path)
        t.add_row(shape, "; ".join(lab.replace("\n", ": ") for lab in labels), f"{measure_bubbles([o[0] for o in out])[1] * 1e3:.0f}",
                  " ".join(f"{x:.2f}" for x in bubbles), f"{f:.2f}", os.path.relpath(path, ROOT))
    console.print(t)
    return paths


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
