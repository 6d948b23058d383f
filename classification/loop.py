"""The training loop behind classification/train.py: epochs of steps, validation, the test split.

    deepspeed --num_gpus 2 classification/train.py     (train.py parses, checks and calls run())

run(): resolve the DeepSpeed config against this run (batch arithmetic, LR schedule), load the
model (+ LoRA adapters, + tensor parallelism), build the engine, then per epoch train on this
rank's batches (batches.py), validate on the whole split (evaluate.py), keep the best checkpoint
by validation accuracy and the engine's own checkpoint for --resume (checkpoints.py); at the end
the test split, once, on the best checkpoint.
Cost: per step the engine's cost (see engines.py); 8 bytes all-reduced on logged steps.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from classification import config as C
from classification import data as D
from classification.batches import collate, epoch_batches, tokenize
from classification.checkpoints import META, check_meta, load_best, save_best
from classification.engines import EngineError, build
from classification.evaluate import evaluate
from classification.metrics import Metrics
from classification.model import ModelError, load_model
from classification.tp import setup
from primitives.log import console, print0
from zero_from_scratch.engine.lora import LoraError, apply_lora, trainable_counts

RESUME_KEYS = ("model", "num_labels", "dataset", "engine", "max_len", "tp")


@dataclass
class Run:
    """What the loop's parts share: the arguments, who this rank is, and the run's clocks."""
    a: object                      # train.py's parsed arguments
    rank: int
    world: int
    drank: int                     # data-parallel rank and size (= rank, world without --tp)
    dworld: int
    dgroup: object                 # the data-parallel process group (None: the world)
    tp: object                     # classification.tp.TP, or None
    threads: int
    t_start: float = field(default_factory=time.time)
    cpu_start: float = field(default_factory=time.process_time)  # CPU time ~ wall time on an idle machine
    metrics: Metrics | None = None
    gas: int = 1                   # gradient accumulation steps
    total: int = 0                 # optimizer steps of the whole run
    epoch: int = 0


def _splits(a, bundle):
    """The training split, and val/test cut to --max-train-samples / --max-eval-samples."""
    train = bundle.train
    if a.max_train_samples:
        train = D.Split(train.texts[:a.max_train_samples], train.labels[:a.max_train_samples])
    if a.max_eval_samples:
        n = a.max_eval_samples
        bundle.val, bundle.test = (D.Split(s.texts[:n], s.labels[:n]) for s in (bundle.val, bundle.test))
    return train


def _resolve(a, raw, n_train, dworld, rank):
    """(micro, gas, facts, cfg): the DeepSpeed config resolved for this run; errors end every rank."""
    micro, gas = raw.get("train_micro_batch_size_per_gpu"), raw.get("gradient_accumulation_steps", 1)
    gas = 1 if gas == "auto" else gas
    try:
        if not isinstance(micro, int) or micro < 1:
            raise C.ConfigError(f"train_micro_batch_size_per_gpu must be a positive integer, got {micro!r}")
        steps_per_epoch = n_train // (micro * gas * dworld)
        facts = C.RunFacts(dworld, steps_per_epoch, a.epochs, a.lr, a.warmup_frac, a.max_steps, a.fp16)
        return micro, gas, facts, C.resolve(raw, facts)
    except C.ConfigError as e:
        raise SystemExit(f"error (rank {rank}): {e} ({n_train} training rows, {dworld} data-parallel ranks)")


def _model(a, num_labels, meta, tp, rank):
    """(model, tokenizer, info): the pretrained classifier, with LoRA adapters (--lora) or sharded (--tp)."""
    torch.manual_seed(a.seed)  # the classifier head: same on every rank
    try:
        model, tok, info = load_model(a.model, num_labels, a.dropout)
    except ModelError as e:
        raise SystemExit(f"error (rank {rank}): {e}")
    if getattr(a, "lora", 0):  # LoRA adapters, the rest frozen (zero_from_scratch/engine/lora.py)
        try:
            model = apply_lora(model, a.lora, a.lora_targets.split(",") if a.lora_targets else None, rank=rank)
        except LoraError as e:
            raise SystemExit(f"error: {e}")
        info["init"] += " + LoRA r={} (trainable {:,} / frozen {:,})".format(a.lora, *trainable_counts(model))
        meta["lora"] = a.lora
    if tp:
        model = tp.shard(model)
        info["init"] += f" + tensor parallel over {tp.tp} ranks (tensor_parallel.engine.parallelize)"
    return model, tok, info


def _train_epoch(engine, batches, skip, ids, labels, pad_id, state, ctx):
    """Steps over this rank's batches from `skip`; logs the loss averaged over data-parallel ranks.
    Returns True once the run's last step is done."""
    a, gas, dworld, world, total, epoch = ctx.a, ctx.gas, ctx.dworld, ctx.world, ctx.total, ctx.epoch
    log_every = 1 if total <= 50 else 10
    with Progress(TextColumn(f"epoch {epoch + 1}/{a.epochs}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
                  disable=ctx.rank != 0) as bar:
        task = bar.add_task("train", total=len(batches), completed=skip, info="")
        t0, c0, seen, run_loss = time.time(), time.process_time(), 0, []
        for i in range(skip, len(batches)):
            loss = engine(**collate(ids, labels, batches[i], pad_id)).loss
            engine.backward(loss)
            engine.step()
            run_loss.append(loss.item())
            seen += len(batches[i]) * dworld
            state["batch"] = i + 1
            if (i + 1) % gas:
                continue
            state["step"] += 1
            rate = seen / (time.time() - t0)
            bar.update(task, completed=i + 1, info=f"loss {np.mean(run_loss[-20:]):.4f}  {rate:.1f} samples/s")
            if state["step"] % log_every == 0 or state["step"] == total:
                recent = torch.tensor([np.mean(run_loss[-10:])], dtype=torch.float64)
                if world > 1:   # logged: the mean over data-parallel ranks, not rank 0's alone
                    dist.all_reduce(recent)   # 8 bytes on logged steps only
                ctx.metrics.log(event="train", step=state["step"], epoch=epoch + 1, loss=recent.item() / world,
                            lr=engine.get_lr(), samples_per_s=rate,
                            cpu_s_per_step=(time.process_time() - c0) / (i + 1 - skip))
            if state["step"] >= total:
                return True
    return False


def _validate(engine, tok, ids, labels, num_labels, state, meta, ctx) -> None:
    """Validation accuracy after an epoch; a new best is saved to OUTPUT_DIR/best (every rank enters)."""
    a, epoch = ctx.a, ctx.epoch
    ev = evaluate(engine.module, ids, labels, num_labels, tok.pad_token_id, ctx.drank, ctx.dworld,
                  forward=engine, group=ctx.dgroup)
    ctx.metrics.log(event="eval", split="val", epoch=epoch + 1, step=state["step"], **ev)
    t = Table(title=f"validation after epoch {epoch + 1} (step {state['step']})")
    for c in ("accuracy", "macro-F1", "loss", "rows", "best so far"):
        t.add_column(c, justify="right")
    better = ev["accuracy"] > state["best_val_accuracy"]
    if better:
        state["best_val_accuracy"], state["best_epoch"] = ev["accuracy"], epoch + 1
        save_best(engine, tok, a.output_dir, {**meta, "val_accuracy": ev["accuracy"], "epoch": epoch + 1,
                                              "step": state["step"]}, ctx.rank, ctx.tp)
    t.add_row(f"{ev['accuracy']:.4f}", f"{ev['macro_f1']:.4f}", f"{ev['loss']:.4f}", str(ev["n"]),
              "yes (saved)" if better else f"no (epoch {state['best_epoch']})")
    print0(t)


def _test(engine, tok, ids, bundle, state, meta, ctx):
    """The test split, once, on the checkpoint chosen by validation accuracy."""
    a = ctx.a
    best = os.path.join(a.output_dir, "best")
    check_meta(best, meta, ("model", "num_labels", "dataset"))
    load_best(engine, best, meta, ctx.tp)
    te = evaluate(engine.module, ids, bundle.test.labels, bundle.num_labels, tok.pad_token_id, ctx.drank,
                  ctx.dworld, forward=engine, group=ctx.dgroup)
    wall = time.time() - ctx.t_start
    ctx.metrics.log(event="test", test_accuracy=te["accuracy"], test_macro_f1=te["macro_f1"], test_loss=te["loss"],
                       test_rows=te["n"], best_epoch=state["best_epoch"], best_val_accuracy=state["best_val_accuracy"],
                       steps=state["step"], wall_s=wall, world_size=ctx.world,
                       cpu_s=time.process_time() - ctx.cpu_start, threads=ctx.threads, engine=a.engine, tp=a.tp)
    t = Table(title=f"test split, best checkpoint (epoch {state['best_epoch']}) - never trained or selected on")
    for c in ("accuracy", "macro-F1", "loss", "rows", "wall time"):
        t.add_column(c, justify="right")
    t.add_row(f"{te['accuracy']:.4f}", f"{te['macro_f1']:.4f}", f"{te['loss']:.4f}", str(te["n"]), f"{wall:.0f} s")
    print0(t)
    print0(f"metrics: {os.path.join(a.output_dir, 'metrics.jsonl')}   best checkpoint: {best}")
    return te


def run(a, raw, bundle, comm, threads, local):
    """Train, validate and test as train.py's arguments `a` and DeepSpeed config `raw` say (every rank)."""
    rank, world = comm.rank, comm.size
    tp = setup(a, comm)               # --tp N: a dp × tp mesh; data and batches go by dp rank
    drank, dworld, dgroup = (tp.dp_rank, tp.dp_size, tp.dp_group) if tp else (rank, world, None)
    ctx = Run(a, rank, world, drank, dworld, dgroup, tp, threads)
    os.makedirs(a.output_dir, exist_ok=True)
    print0(D.summary_table(bundle))
    meta = {"model": a.model, "num_labels": bundle.num_labels, "label_names": bundle.label_names,
            "dataset": a.dataset, "engine": a.engine, "max_len": a.max_len, "tp": a.tp}
    ckpt = os.path.join(a.output_dir, "engine")
    if a.resume:  # before the expensive part: a checkpoint from another run fails fast
        if not os.path.isdir(os.path.join(ckpt, "last")):
            raise SystemExit(f"error (rank {rank}): --resume but no checkpoint at {ckpt}/last")
        check_meta(ckpt, meta, RESUME_KEYS)
    train = _splits(a, bundle)
    micro, gas, facts, cfg = _resolve(a, raw, len(train), dworld, rank)
    model, tok, info = _model(a, bundle.num_labels, meta, tp, rank)
    # dropout differs per replica, like DDP; the tp ranks of one replica must draw the same masks
    # on their (replicated) activations, so they share a seed
    torch.manual_seed(a.seed * 1000 + drank + 1)
    tr_ids, va_ids, te_ids = (tokenize(tok, s.texts, a.max_len) for s in (train, bundle.val, bundle.test))
    meta["architecture"] = type(model).__name__
    try:
        engine = build(a.engine, model, cfg, comm, mpu=tp.mpu() if tp else None)
    except EngineError as e:
        raise SystemExit(f"error (rank {rank}): {e}")
    extra = [("config file", a.config, "", "--config / --deepspeed_config"),
             ("model", a.model, info["init"], info["source"]),
             ("ranks x threads", "", f"{world} x {threads}", f"{local} on this node; backend {comm.backend}")]
    if tp:
        extra.append(("tensor parallel", str(a.tp), f"dp {dworld} x tp {a.tp}", "the engine shards over dp (mpu)"))
    print0(C.table(facts, cfg, extra + engine.describe()))
    for w in facts.warnings:
        print0(f"[yellow]warning:[/yellow] {w}")

    state = {"epoch": 0, "batch": 0, "step": 0, "best_val_accuracy": -1.0, "best_epoch": -1}
    if a.resume:
        state = engine.load(ckpt, "last")
        print0(f"resumed from {ckpt}/last at epoch {state['epoch']}, step {state['step']}")
    ctx.metrics = Metrics(a.output_dir, rank, append=a.resume, tb_dir=getattr(a, "tensorboard", None))
    ctx.gas, ctx.total = gas, facts.total_steps
    engine.train()
    lengths = [len(t) for t in tr_ids]
    done = state["step"] >= ctx.total
    for epoch in range(state["epoch"], a.epochs):
        if done:
            break
        ctx.epoch = epoch
        batches = epoch_batches(lengths, micro, gas, dworld, drank, a.seed, epoch)
        skip = state["batch"] if epoch == state["epoch"] else 0
        done = _train_epoch(engine, batches, skip, tr_ids, train.labels, tok.pad_token_id, state, ctx)
        _validate(engine, tok, va_ids, bundle.val.labels, bundle.num_labels, state, meta, ctx)
        finished_epoch = state["batch"] >= len(batches)
        state.update(epoch=epoch + 1 if finished_epoch else epoch, batch=0 if finished_epoch else state["batch"])
        engine.save(ckpt, "last", dict(state))
        if rank == 0:
            with open(os.path.join(ckpt, META), "w") as f:
                json.dump(meta, f, indent=1)
    return _test(engine, tok, te_ids, bundle, state, meta, ctx)
