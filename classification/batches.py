"""The training loop behind classification/train.py: batches, epochs, evaluation, checkpoints.

    deepspeed --num_gpus 2 classification/train.py     (train.py parses, checks and calls run())

Data order: per epoch a seeded permutation, cut into global batches (micro x accumulation x world)
whose texts have similar lengths (sorted within chunks of 50 global batches, then the batches are
shuffled), and rank r takes every world-th text of each one, so ranks see equal lengths and do equal
numbers of steps (an unequal count would hang the collective). Evaluation shards the split over
ranks and sums correct counts, loss and the confusion matrix with one all-reduce; every rank runs
the same number of evaluation batches (a rank with one row fewer pads with a zero-weight row), since
under ZeRO-3 each forward gathers parameters collectively. Weights are gathered whole for
save_pretrained and for loading the best checkpoint (engine.full_parameters).
Cost: tokenisation once, O(rows); per step the engine's cost (see engines.py).
"""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from classification import config as C
from classification import data as D
from classification.engines import EngineError, build
from classification.model import ModelError, load_model
from primitives.engine.log import console, print0

META = "ringzero.json"


def tokenize(tok, texts, max_len):
    return tok(list(texts), truncation=True, max_length=max_len)["input_ids"]


def collate(ids, labels, idx, pad_id):
    L = max(len(ids[i]) for i in idx)
    x = torch.full((len(idx), L), pad_id, dtype=torch.long)
    m = torch.zeros((len(idx), L), dtype=torch.long)
    for r, i in enumerate(idx):
        x[r, :len(ids[i])] = torch.tensor(ids[i])
        m[r, :len(ids[i])] = 1
    return {"input_ids": x, "attention_mask": m, "labels": torch.tensor([labels[i] for i in idx])}


def epoch_batches(lengths, micro, gas, world, rank, seed, epoch, chunk=50):
    """This rank's micro-batches (lists of row indices) for one epoch; drops the last partial batch."""
    g = micro * gas * world
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))[: len(lengths) // g * g]
    lengths = np.asarray(lengths)
    for s in range(0, len(perm), g * chunk):  # similar lengths inside a global batch: less padding
        c = perm[s:s + g * chunk]
        perm[s:s + g * chunk] = c[np.argsort(lengths[c], kind="stable")]
    gb = perm.reshape(-1, g)[rng.permutation(len(perm) // g)]
    out = []
    for b in gb:
        mine = b[rank::world]
        out += [mine[k * micro:(k + 1) * micro].tolist() for k in range(gas)]
    return out


def eval_batches(n, lengths_order, rank, world, batch):
    """This rank's evaluation batches: (row indices, how many of them count). Rows are dealt
    round-robin in length order; every rank gets ceil(ceil(n / world) / batch) batches, the same
    number everywhere, and a rank left without rows for the last one re-reads row 0 with weight 0."""
    mine = lengths_order[rank::world].tolist()
    per_rank = -(-n // world)
    out = []
    for s in range(0, per_rank, batch):
        idx = mine[s:s + batch]
        out.append((idx, len(idx)) if idx else ([int(lengths_order[0])], 0))
    return out


@torch.no_grad()
def evaluate(model, ids, labels, num_labels, pad_id, rank, world, batch=64, forward=None, group=None):
    """accuracy, macro-F1 and mean loss over the whole split (sharded over ranks, then summed).
    forward: the engine's forward (defaults to model's). With --tp, rank/world/group are the
    data-parallel ones (the tp ranks of a replica compute the same rows together)."""
    was = model.training
    model.eval()
    forward = forward or model
    conf = torch.zeros(num_labels, num_labels, dtype=torch.float64)  # rows: true, cols: predicted
    loss_sum = torch.zeros(1, dtype=torch.float64)
    for idx, keep in eval_batches(len(ids), np.argsort([len(t) for t in ids], kind="stable"), rank, world, batch):
        b = collate(ids, labels, idx, pad_id)
        out = forward(**b)
        if not keep:
            continue
        loss_sum += out.loss.double() * len(b["labels"])
        pred = out.logits.argmax(-1)
        conf.index_put_((b["labels"], pred), torch.ones(len(pred), dtype=torch.float64), accumulate=True)
    if world > 1:
        t = torch.cat([conf.flatten(), loss_sum])
        dist.all_reduce(t, group=group)
        conf, loss_sum = t[:-1].view(num_labels, num_labels), t[-1:]
    model.train(was)
    n = conf.sum().item()
    tp = conf.diag()
    f1 = (2 * tp / (conf.sum(0) + conf.sum(1)).clamp(min=1)).mean().item()
    return {"accuracy": tp.sum().item() / n, "macro_f1": f1, "loss": loss_sum.item() / n, "n": int(n)}


class Metrics:
    """Rank 0 appends JSON lines (one flushed line per record) and, when installed, TensorBoard."""

    def __init__(self, out_dir, rank, append, tb_dir=None):
        self.f = self.tb = None
        if rank != 0:
            return
        self.f = open(os.path.join(out_dir, "metrics.jsonl"), "a" if append else "w")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard not installed: JSONL only, unless --tensorboard asked for it
            if tb_dir:
                raise SystemExit("error: --tensorboard needs `pip install tensorboard`") from None
            return
        self.tb = SummaryWriter(tb_dir or os.path.join(out_dir, "tb"))

    def log(self, **rec):
        if self.f:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
            if self.tb and "step" in rec:
                for k, v in rec.items():
                    if isinstance(v, (int, float)) and k != "step":
                        self.tb.add_scalar(f"{rec.get('event', '')}/{k}", v, rec["step"])
                self.tb.flush()


def save_best(engine, tok, out_dir, meta, rank, tp=None):
    """OUTPUT_DIR/best: Hugging Face save_pretrained + ringzero.json, written to a temporary folder
    and renamed, so a crash never leaves a half-written best checkpoint. Every rank enters (ZeRO-3
    gathers the weights; --tp gathers the shards into the full state dict); rank 0 writes."""
    with engine.full_parameters():
        sd = tp.full_state_dict(engine.module) if tp else None
        if rank == 0:
            _write_best(engine.module, tok, out_dir, meta, sd)
    if dist.is_initialized():
        dist.barrier()


def _write_best(model, tok, out_dir, meta, state_dict=None):
    final, tmp, old = (os.path.join(out_dir, n) for n in ("best", "best.tmp", "best.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
    if os.path.isdir(final):               # moved aside, not deleted, until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def check_meta(path, meta, what):
    """A checkpoint written for another model / dataset / engine is an error, not a silent mix."""
    f = os.path.join(path, META)
    if not os.path.isfile(f):
        raise SystemExit(f"error: {path} has no {META}: not a checkpoint written by classification/train.py")
    with open(f) as fh:
        have = json.load(fh)
    have.setdefault("tp", 1)              # written before --tp went through this loop
    diff = {k: (have.get(k), meta[k]) for k in what if have.get(k) != meta[k]}
    if diff:
        raise SystemExit(f"error: checkpoint {path} belongs to another run: " +
                         ", ".join(f"{k} is {h!r} there, {w!r} here" for k, (h, w) in diff.items()))
    return have


def run(a, raw, bundle, comm, threads, local):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table
    rank, world = comm.rank, comm.size
    from classification.tp import setup
    tp = setup(a, comm)               # --tp N: a dp × tp mesh; data and batches go by dp rank
    drank, dworld, dgroup = (tp.dp_rank, tp.dp_size, tp.dp_group) if tp else (rank, world, None)
    t_start, cpu_start = time.time(), time.process_time()  # CPU time ~ wall time on an idle machine
    os.makedirs(a.output_dir, exist_ok=True)
    print0(D.summary_table(bundle))
    meta = {"model": a.model, "num_labels": bundle.num_labels, "label_names": bundle.label_names,
            "dataset": a.dataset, "engine": a.engine, "max_len": a.max_len, "tp": a.tp}
    ckpt = os.path.join(a.output_dir, "engine")
    if a.resume:  # before the expensive part: a checkpoint from another run fails fast
        if not os.path.isdir(os.path.join(ckpt, "last")):
            raise SystemExit(f"error (rank {rank}): --resume but no checkpoint at {ckpt}/last")
        check_meta(ckpt, meta, ("model", "num_labels", "dataset", "engine", "max_len", "tp"))
    train = bundle.train
    if a.max_train_samples:
        train = D.Split(train.texts[:a.max_train_samples], train.labels[:a.max_train_samples])
    if a.max_eval_samples:
        n = a.max_eval_samples
        bundle.val, bundle.test = (D.Split(s.texts[:n], s.labels[:n]) for s in (bundle.val, bundle.test))
    micro, gas = raw.get("train_micro_batch_size_per_gpu"), raw.get("gradient_accumulation_steps", 1)
    gas = 1 if gas == "auto" else gas
    try:
        if not isinstance(micro, int) or micro < 1:
            raise C.ConfigError(f"train_micro_batch_size_per_gpu must be a positive integer, got {micro!r}")
        steps_per_epoch = len(train) // (micro * gas * dworld)
        facts = C.RunFacts(dworld, steps_per_epoch, a.epochs, a.lr, a.warmup_frac, a.max_steps, a.fp16)
        cfg = C.resolve(raw, facts)
    except C.ConfigError as e:
        raise SystemExit(f"error (rank {rank}): {e} ({len(train)} training rows, {dworld} data-parallel ranks)")
    torch.manual_seed(a.seed)  # the classifier head: same on every rank
    try:
        model, tok, info = load_model(a.model, bundle.num_labels, a.dropout)
    except ModelError as e:
        raise SystemExit(f"error (rank {rank}): {e}")
    if getattr(a, "lora", 0):  # issue 13: LoRA adapters, the rest frozen (recipes/lora.py)
        from recipes.lora import LoraError, apply_lora, trainable_counts
        try:
            model = apply_lora(model, a.lora, a.lora_targets.split(",") if a.lora_targets else None, rank=rank)
        except LoraError as e:
            raise SystemExit(f"error: {e}")
        info["init"] += " + LoRA r={} (trainable {:,} / frozen {:,})".format(a.lora, *trainable_counts(model))
        meta["lora"] = a.lora
    if tp:
        model = tp.shard(model)
        info["init"] += f" + tensor parallel over {tp.tp} ranks (tensor_parallel.engine.parallelize)"
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
    metrics = Metrics(a.output_dir, rank, append=a.resume, tb_dir=getattr(a, "tensorboard", None))
    total = facts.total_steps
    log_every = 1 if total <= 50 else 10
    engine.train()
    lengths = [len(t) for t in tr_ids]
    done = state["step"] >= total
    for epoch in range(state["epoch"], a.epochs):
        if done:
            break
        batches = epoch_batches(lengths, micro, gas, dworld, drank, a.seed, epoch)
        skip = state["batch"] if epoch == state["epoch"] else 0
        with Progress(TextColumn(f"epoch {epoch + 1}/{a.epochs}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
                      disable=rank != 0) as bar:
            task = bar.add_task("train", total=len(batches), completed=skip, info="")
            t0, c0, seen, run_loss = time.time(), time.process_time(), 0, []
            for i in range(skip, len(batches)):
                b = collate(tr_ids, train.labels, batches[i], tok.pad_token_id)
                loss = engine(**b).loss
                engine.backward(loss)
                engine.step()
                run_loss.append(loss.item())
                seen += len(batches[i]) * dworld
                state["batch"] = i + 1
                if (i + 1) % gas == 0:
                    state["step"] += 1
                    rate = seen / (time.time() - t0)
                    bar.update(task, completed=i + 1, info=f"loss {np.mean(run_loss[-20:]):.4f}  {rate:.1f} samples/s")
                    if state["step"] % log_every == 0 or state["step"] == total:
                        recent = torch.tensor([np.mean(run_loss[-10:])], dtype=torch.float64)
                        if world > 1:   # logged: the mean over data-parallel ranks, not rank 0's alone
                            dist.all_reduce(recent)   # 8 bytes on logged steps only
                        metrics.log(event="train", step=state["step"], epoch=epoch + 1, loss=recent.item() / world,
                                    lr=engine.get_lr(), samples_per_s=rate,
                                    cpu_s_per_step=(time.process_time() - c0) / (i + 1 - skip))
                    if state["step"] >= total:
                        done = True
                        break
        ev = evaluate(engine.module, va_ids, bundle.val.labels, bundle.num_labels, tok.pad_token_id, drank, dworld,
                      forward=engine, group=dgroup)
        metrics.log(event="eval", split="val", epoch=epoch + 1, step=state["step"], **ev)
        t = Table(title=f"validation after epoch {epoch + 1} (step {state['step']})")
        for c in ("accuracy", "macro-F1", "loss", "rows", "best so far"):
            t.add_column(c, justify="right")
        better = ev["accuracy"] > state["best_val_accuracy"]
        if better:
            state["best_val_accuracy"], state["best_epoch"] = ev["accuracy"], epoch + 1
            save_best(engine, tok, a.output_dir, {**meta, "val_accuracy": ev["accuracy"], "epoch": epoch + 1,
                                                         "step": state["step"]}, rank, tp)
        t.add_row(f"{ev['accuracy']:.4f}", f"{ev['macro_f1']:.4f}", f"{ev['loss']:.4f}", str(ev["n"]),
                  "yes (saved)" if better else f"no (epoch {state['best_epoch']})")
        print0(t)
        finished_epoch = state["batch"] >= len(batches)
        state.update(epoch=epoch + 1 if finished_epoch else epoch, batch=0 if finished_epoch else state["batch"])
        engine.save(ckpt, "last", dict(state))
        if rank == 0:
            with open(os.path.join(ckpt, META), "w") as f:
                json.dump(meta, f, indent=1)

    # the test split, once, on the checkpoint chosen by validation accuracy
    best = os.path.join(a.output_dir, "best")
    check_meta(best, meta, ("model", "num_labels", "dataset"))
    from safetensors.torch import load_file
    with engine.full_parameters(modify=True):  # ZeRO-3: rank 0's loaded weights go back into every shard
        if meta.get("lora"):  # peft saved the adapters and the head only
            from peft import set_peft_model_state_dict
            set_peft_model_state_dict(engine.module, load_file(os.path.join(best, "adapter_model.safetensors")))
        elif tp:  # best is unsharded: each rank narrows it to its own slices
            tp.load_full(engine.module, load_file(os.path.join(best, "model.safetensors")))
        else:
            engine.module.load_state_dict(load_file(os.path.join(best, "model.safetensors")))
    te = evaluate(engine.module, te_ids, bundle.test.labels, bundle.num_labels, tok.pad_token_id, drank, dworld,
                  forward=engine, group=dgroup)
    wall = time.time() - t_start
    metrics.log(event="test", test_accuracy=te["accuracy"], test_macro_f1=te["macro_f1"], test_loss=te["loss"],
                test_rows=te["n"], best_epoch=state["best_epoch"], best_val_accuracy=state["best_val_accuracy"], steps=state["step"], wall_s=wall, world_size=world,
                cpu_s=time.process_time() - cpu_start, threads=threads,
                engine=a.engine, tp=a.tp)
    t = Table(title=f"test split, best checkpoint (epoch {state['best_epoch']}) - never trained or selected on")
    for c in ("accuracy", "macro-F1", "loss", "rows", "wall time"):
        t.add_column(c, justify="right")
    t.add_row(f"{te['accuracy']:.4f}", f"{te['macro_f1']:.4f}", f"{te['loss']:.4f}", str(te["n"]), f"{wall:.0f} s")
    print0(t)
    print0(f"metrics: {os.path.join(a.output_dir, 'metrics.jsonl')}   best checkpoint: {best}")
    return te
