"""The --pp > 1 loop of classification/parallel/train.py: DistilBERT on pipeline_parallel's engine, its
blocks tensor-parallel, its stages data-parallel (the launch commands and the cost per step
are in train.py's docstring).

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2

One mesh (primitives.mesh.Mesh.build(dp, pp, tp)) gives every group: the engine's pipeline
peers are this rank's (dp, tp) coordinate on the neighbouring stage (mesh.pp_group), its
gradient average runs over mesh.dp_group, the blocks' collectives over mesh.tp_group. Bytes
per axis come from the ledger, per executor instruction (engine.step_bytes), next to the
formulas of train.py's docstring.
"""
from __future__ import annotations

import resource
import time

import torch
from rich.table import Table

import pipeline_parallel
import primitives as P
from classification import data as D
from classification.mesh_table import mesh_table
from classification.model import distilbert_config, load_offline_model
from classification.parallel.pipeline import (accuracy, classification_loss, distilbert_layers, pack,
                                              stage_bounds)
from classification.parallel.tokens import Tokenized
from pipeline_parallel.engine.module import PipelineModule
from primitives.engine.cost import traffic
from primitives.log import print0
from primitives.mesh import Mesh
from tensor_parallel.engine.formulas import layer_traffic
from tensor_parallel.engine.state_dict import sharded_numel


def _batches(rows, order, mb: int, m: int, replica: int, replicas: int, steps: int):
    """Micro-batch j of step t for `replica`: rows[order[(t·dp + replica)·m·mb + j·mb …]] (wrapping)."""
    for t in range(steps):
        for j in range(m):
            start = ((t * replicas + replica) * m + j) * mb
            ids, mask, labels = rows[order[(start + torch.arange(mb)) % len(order)]]
            yield pack(ids, mask), labels


def expected_bytes(engine, cfg, a, mb: int, stage_params: int) -> dict:
    """Per step and rank, by axis: the formulas of train.py's docstring (ring algorithms)."""
    m, s, h = a.micro_batches, a.max_len, cfg.dim
    blocks = cfg.n_layers // a.pp
    ar = lambda n, numel, r: traffic("all_reduce", "ring", n, r, numel, 4)[1] if n > 1 else 0  # noqa: E731
    tp = m * (blocks * layer_traffic(mb, s, h, a.tp, engine.tp_rank, False)[1]
              + (ar(a.tp, mb * s * h, engine.tp_rank) if engine.is_first_stage() else 0))
    pp = m * mb * s * (h + 1) * 4 * ((not engine.is_first_stage()) + (not engine.is_last_stage()))
    return {"tp": tp, "pp": pp, "dp": ar(engine.dp, stage_params, engine.dp_rank)}


def run_pipeline(a, comm) -> dict:
    world, rank = comm.size, comm.rank
    cfg = distilbert_config(2, a.dropout)
    bounds = stage_bounds(cfg.n_layers, a.pp, rank)           # StageError on every rank, before any work
    dp = a.dp or max(1, world // (a.tp * a.pp))
    mesh = Mesh.build(dp=dp, pp=a.pp, tp=a.tp)              # MeshError on every rank if it does not factor
    print0(mesh_table(mesh.layout))
    torch.manual_seed(a.seed)                                # the same head init and dropout stream everywhere
    bundle = D.load(getattr(a, "dataset", D.DEFAULT_DATASET))
    model, tok = load_offline_model(num_labels=bundle.num_labels, dropout=a.dropout)
    cfg = model.config
    layers, source = distilbert_layers(model, mesh.tp_group, a.tp)
    del model
    mb = a.batch // a.micro_batches
    pm = PipelineModule(layers, num_stages=a.pp, loss_fn=classification_loss, partition_method=bounds)
    config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": a.micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.01, "torch_adam": True}},
              "gradient_clipping": a.clip, "steps_per_print": 10 ** 9, "pipeline": {"schedule": a.schedule}}
    engine, *_ = pipeline_parallel.initialize(model=pm, config=config, mesh=mesh)
    source.release()                                         # this rank keeps only its stage's shards
    held, stage_full = sharded_numel(torch.nn.ModuleList(engine.chunks))
    print0(f"pp={a.pp} stages × {cfg.n_layers // a.pp} blocks, schedule {a.schedule}, m={a.micro_batches} micro-batches "
           f"of {mb} × {a.max_len} tokens per replica, global batch {a.batch * dp}, clip {a.clip}")
    rows = Tokenized(tok, bundle.train, a.max_len)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(a.seed))
    it = _batches(rows, order, mb, a.micro_batches, engine.dp_rank, dp, a.steps)
    sent = {"tp": 0, "pp": 0, "dp": 0}
    t0 = time.perf_counter()
    for step in range(a.steps):
        loss = engine.train_batch(it)
        sent = {k: v + engine.step_bytes[k] for k, v in sent.items()}
        if step % a.log_every == 0 or step == a.steps - 1:
            print0(f"step {step:4d}  loss {loss:.4f}  grad norm {engine.global_grad_norm:.3f}  "
                   f"{(time.perf_counter() - t0) / (step + 1):.2f} s/step")
    secs = (time.perf_counter() - t0) / a.steps
    acc, rows = evaluate(engine, tok, bundle.val, a, mb, dp)
    want = expected_bytes(engine, cfg, a, mb, held)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats = torch.tensor([sent["tp"] / a.steps, sent["pp"] / a.steps, sent["dp"] / a.steps, want["tp"], want["pp"],
                          want["dp"], rss, held, stage_full], dtype=torch.float64)
    out = [torch.zeros_like(stats) for _ in range(world)]
    P.all_gather(out, stats)
    t = Table(title=f"dp={dp} × pp={a.pp} × tp={a.tp}: {a.steps} steps, batch {a.batch}/replica, {secs:.2f} s/step, "
                    f"val accuracy {acc:.3f} on {rows} rows; bytes sent per step (formula in brackets)")
    for c in ("rank", "(pp, dp, tp)", "TP bytes", "PP bytes", "DP bytes", "peak RSS MiB", "params held"):
        t.add_column(c, justify="right")
    # the unsharded model: each stage's full size once (from its dp = 0, tp = 0 rank)
    full = int(sum(o[-1] for r, o in enumerate(out) if mesh.layout.coords_of(r)[1:] == (0, 0)))
    for r, row in enumerate(out):
        tb, pb, db, wt, wp, wd, m, n, _ = row.tolist()
        t.add_row(str(r), str(mesh.layout.coords_of(r)), f"{tb:,.0f} ({wt:,.0f})", f"{pb:,.0f} ({wp:,.0f})",
                  f"{db:,.0f} ({wd:,.0f})", f"{m:,.0f}", f"{n:,.0f} of {full:,}")
    print0(t)
    return {"accuracy": acc, "s_per_step": secs, "loss": loss, "bytes": sent, "expected": want}


@torch.no_grad()
def evaluate(engine, tok, split, a, mb: int, dp: int):
    """Accuracy over whole eval batches (m·mb rows per replica): eval_batch averages its loss_fn
    over micro-batches and replicas, so with the accuracy as loss_fn it averages the accuracy."""
    if not a.eval_samples:
        return float("nan"), 0
    rows = Tokenized(tok, split, a.max_len)
    per = a.micro_batches * mb * dp
    n = max(1, min(a.eval_samples, len(rows)) // per)
    it = _batches(rows, torch.arange(len(rows)), mb, a.micro_batches, engine.dp_rank, dp, n)
    train_loss, engine.loss_fn = engine.loss_fn, accuracy
    try:
        acc = sum(engine.eval_batch(it) for _ in range(n)) / n
    finally:
        engine.loss_fn = train_loss
    return acc, n * per
