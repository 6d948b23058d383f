"""Fine-tune the offline DistilBERT classifier with data × pipeline × tensor parallelism.

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2
    torchrun --standalone --nproc_per_node 4 classification/parallel/train.py --dp 2 --tp 2
    torchrun --standalone --nproc_per_node 2 classification/parallel/train.py --tp 2 --sequence-parallel
    python classification/parallel/train.py --steps 5                       # a world of one

The mesh (primitives.mesh: tp fastest, then dp, then pp) puts tensor-parallel ranks next to
each other. Every tp rank of a replica reads the same batch; each dp replica reads its own.
Printed: the mesh, the loss, bytes sent per step and rank (tp, pp and dp apart), peak RSS,
held parameters, and the validation accuracy at the end.

--pp 1: this file's loop. Per step and rank: the TP traffic of
  tensor_parallel.engine.formulas.distilbert_traffic, then one all-reduce (AVG) of this rank's gradient
  shard over the dp group, 2(dp-1)/dp × 4 bytes × params-per-rank.
--pp > 1: pipeline_parallel's engine (schedule --schedule, m = --micro-batches of --batch/m rows)
  on the stages of classification/parallel/pipeline.py (pp must divide the 6 blocks). Per step and rank:
  TP  per micro-batch, 4 all-reduces of b·s·h per block of this stage (+1 for the vocab-parallel
      embedding on stage 0): 2(tp-1)/tp × 4 bytes each (ring);
  PP  2·m·b·s·(h+1)·4 bytes per stage boundary this rank touches (activations down, gradients
      up; the +1 channel is the attention mask);
  DP  one all-reduce of the stage's gradient shard, 2(dp-1)/dp × 4 bytes × params-per-rank;
  then the global gradient norm (tp- and pp-aware, engine.step) clipped to --clip, AdamW.
--sequence-parallel needs --pp 1; --micro-batches, --schedule and --clip need --pp > 1.
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import torch
from rich.table import Table

import primitives as P
from classification import data as D
from classification.mesh_table import mesh_table
from classification.model import load_offline_model
from classification.parallel.loop3d import run_pipeline
from classification.parallel.pipeline import StageError
from classification.parallel.tokens import Tokenized
from primitives.coalesced import all_reduce_coalesced
from primitives.launch import add_launch_args, init_from_env
from primitives.engine.ledger import LEDGER
from primitives.log import print0
from primitives.mesh import Mesh, MeshError
from tensor_parallel.engine.parallelize import parallelize
from tensor_parallel.engine.state_dict import sharded_numel


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="DistilBERT classification with data × tensor parallelism")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: world / (tp·pp))")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (must divide DistilBERT's 6 blocks)")
    ap.add_argument("--micro-batches", type=int, default=None, help="--pp > 1: micro-batches per step (default 4)")
    ap.add_argument("--schedule", default=None, choices=["naive", "gpipe", "1f1b"], help="--pp > 1 (default 1f1b)")
    ap.add_argument("--clip", type=float, default=None, help="--pp > 1: global gradient-norm clipping (default 1.0)")
    ap.add_argument("--sequence-parallel", action="store_true", help="Megatron-SP inside each tp group")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=16, help="examples per step and dp replica")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-len", type=int, default=64, help="tokens per text (padded: SP needs s %% tp == 0)")
    ap.add_argument("--eval-samples", type=int, default=400, help="validation rows for the final accuracy (0 = none)")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    add_launch_args(ap)
    a = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    for k in ("tp", "pp", "steps", "batch", "max_len"):
        if getattr(a, k) < 1:
            ap.error(f"(rank {rank}) --{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if a.pp == 1:
        given = [f"--{k.replace('_', '-')}" for k in ("micro_batches", "schedule", "clip") if getattr(a, k) is not None]
        if given:
            ap.error(f"(rank {rank}) {', '.join(given)} apply to the pipeline (--pp > 1); with --pp 1 there is one "
                     "batch per step and no clipping")
    else:
        if a.sequence_parallel:
            ap.error(f"(rank {rank}) --sequence-parallel needs --pp 1 (its split/gather hooks wrap the whole encoder)")
        a.micro_batches = 4 if a.micro_batches is None else a.micro_batches
        a.schedule, a.clip = a.schedule or "1f1b", 1.0 if a.clip is None else a.clip
        if a.micro_batches < 1 or a.batch % a.micro_batches:
            ap.error(f"(rank {rank}) --batch {a.batch} must be a positive multiple of --micro-batches {a.micro_batches}")
    if a.sequence_parallel and a.max_len % a.tp:
        ap.error(f"(rank {rank}) --sequence-parallel needs --max-len ({a.max_len}) divisible by --tp ({a.tp})")
    return a


def _sync_dp(model, dp_comm):
    """One AVG all-reduce of every gradient of this rank (a flat buffer) over the dp group;
    parameters without a gradient (unused this step) are left out, on every dp rank alike."""
    all_reduce_coalesced(dp_comm, [p.grad for p in model.parameters() if p.grad is not None], "avg")


def run(a, comm) -> dict:
    if a.pp > 1:
        return run_pipeline(a, comm)
    world = comm.size
    dp = a.dp or world // (a.tp * a.pp)
    mesh = Mesh.build(dp=dp, pp=a.pp, tp=a.tp)          # MeshError on every rank if it does not factor
    print0(mesh_table(mesh.layout))
    _, d, _ = mesh.coords
    torch.manual_seed(a.seed)                            # the same head init on every rank
    bundle = D.load(getattr(a, "dataset", D.DEFAULT_DATASET))
    model, tok = load_offline_model(num_labels=bundle.num_labels, dropout=a.dropout)
    parallelize(model, mesh.tp_group, sequence_parallel=a.sequence_parallel)
    local, full = sharded_numel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    rows = Tokenized(tok, bundle.train, a.max_len)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(a.seed))
    dpc = P.get_comm(mesh.dp_group) if dp > 1 else None
    tp_bytes = dp_bytes = 0
    t0 = time.perf_counter()
    model.train()
    for step in range(a.steps):
        ids, mask, labels = rows[order[(step * a.batch * dp + d * a.batch + torch.arange(a.batch)) % len(order)]]
        with LEDGER.track() as t:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        with LEDGER.track() as g:
            if dpc:
                _sync_dp(model, dpc)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tp_bytes, dp_bytes = tp_bytes + t.bytes_sent, dp_bytes + g.bytes_sent
        if step % a.log_every == 0 or step == a.steps - 1:
            lv = loss.detach().clone().reshape(1)
            if dpc:
                P.all_reduce(lv, op=P.ReduceOp.AVG, group=mesh.dp_group)
            print0(f"step {step:4d}  loss {lv.item():.4f}  {(time.perf_counter() - t0) / (step + 1):.2f} s/step")
    secs = (time.perf_counter() - t0) / a.steps
    acc = evaluate(model, tok, bundle.val, a, mesh, dp, d) if a.eval_samples else float("nan")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats = torch.tensor([tp_bytes / a.steps, dp_bytes / a.steps, rss, local], dtype=torch.float64)
    rows = [torch.zeros_like(stats) for _ in range(world)]
    P.all_gather(rows, stats)
    t = Table(title=f"dp={dp} × tp={a.tp}{' + SP' if a.sequence_parallel else ''}: {a.steps} steps, "
                    f"batch {a.batch}/replica, {secs:.2f} s/step, "
                    + (f"val accuracy {acc:.3f}" if a.eval_samples else "no validation (--eval-samples 0)"))
    for c in ("rank", "(pp, dp, tp)", "TP bytes sent/step", "DP bytes sent/step", "peak RSS MiB", "params held"):
        t.add_column(c, justify="right")
    for r, row in enumerate(rows):
        tb, db, m, n = row.tolist()
        t.add_row(str(r), str(mesh.layout.coords_of(r)), f"{tb:,.0f}", f"{db:,.0f}", f"{m:,.0f}",
                  f"{n:,.0f} of {full:,}")
    print0(t)
    return {"accuracy": acc, "s_per_step": secs, "loss": loss.item()}


@torch.no_grad()
def evaluate(model, tok, split, a, mesh, dp, d):
    """Accuracy on the first eval_samples validation rows; dp replicas split them, tp ranks agree."""
    model.eval()
    rows = Tokenized(tok, split, a.max_len)
    n = min(a.eval_samples, len(rows))
    mine = torch.arange(n)[d::dp]
    correct = torch.zeros(2, dtype=torch.float64)
    for chunk in mine.split(64):
        ids, mask, labels = rows[chunk]
        pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        correct += torch.tensor([(pred == labels).sum().item(), len(chunk)], dtype=torch.float64)
    if dp > 1:
        P.all_reduce(correct, group=mesh.dp_group)
    model.train()
    return (correct[0] / correct[1]).item()


def main(argv=None):
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    comm = init_from_env(a.backend, a.timeout)
    try:
        return run(a, comm)
    except (MeshError, StageError) as e:          # a layout the world cannot take: one line per rank
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
