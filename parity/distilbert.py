"""DeepSpeed ZeRO-2 vs this toolkit's ZeRO-2, step by step, on the classification model.

    python -m parity.distilbert --tiny        # CI size: DistilBERT dim 32, 2 layers, 5 steps (~30 s)
    python -m parity.distilbert               # the real model: MiniLM weights mapped into DistilBERT
                                                  #   (22.7 M params), 10 steps × 2 ranks × 32 texts, max_len 64
    python -m parity.distilbert --steps 20 --json parity.json

Both engines are driven by the same classification/ds_config_zero2.json (its "auto" values
resolved by classification/config.py), start from the same weights (dropout 0) and see the same
Rotten Tomatoes batches in the same order (classification/batches.py: the length-bucketed sampler). They
run side by side in the same 2 processes (spawned, gloo), one optimizer step each in turn, so
after every step the full parameters are compared. Exit status 1 when any step is outside the
tolerance (parity.zero.compare.Tolerance, which explains its numbers).
Cost: 2 × steps × (forward + backward + ZeRO-2 step) per rank, plus one parameter copy per step.

Why the two columns are not bit-identical, and why the drift stays at rounding level (fp32):
  * pre-division by N: DeepSpeed scales gradients by 1/N before its reduce-scatter; ours sums,
    then scales by coef/N in the step. For N = 2 dividing by 2 is exact, so this is silent here.
  * reduction order: with N = 2 each element is a + b either way (commutative, exact order);
    with N > 2 a ring adds in a chunk-dependent order, (a+b)+c ≠ a+(b+c).
  * per-owner reduce vs reduce-scatter: DeepSpeed reduces bucket by bucket (reduce_bucket_size),
    ours reduce-scatters flat shards: same sums, different grouping for N > 2.
  * the global gradient norm sums per-parameter squares (DeepSpeed) or per-shard squares (ours):
    another order, ~1e-7 relative; the clip coefficient and so every update inherit it.
  * Adam: both torch.optim.AdamW formulas, but DeepSpeed calls torch's per-tensor kernel and ours
    updates a flat shard; lr·m̂/(√v̂+ε) may round differently by one ulp.
  * Adam magnifies absolute noise in gradients smaller than ε = 1e-8 (update ≈ lr·g/ε), which is
    why the largest parameter differences sit in embedding rows that barely get a gradient.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from classification import config as C
from classification import data as D
from classification import model as M
from classification.batches import collate, epoch_batches, tokenize
from primitives.log import console
from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.models import tiny_distilbert
from parity.zero.compare import render
from parity.zero.ds_parity import run_parities
from parity.zero.harness import Job

BUGS = ("none", "weight_decay_groups")


def tiny_model():
    """Random-init DistilBERT (dim 32, 2 layers, 2 heads) over the real 30,522-token vocabulary."""
    return tiny_distilbert(vocab=M.VOCAB_SIZE, hidden=64, max_positions=512)


def full_arch():
    """The classification architecture with dropout off; the weights come from the parent process."""
    from transformers import DistilBertForSequenceClassification   # optional dependency: transformers
    return DistilBertForSequenceClassification(M.distilbert_config(2, dropout=0.0))


def make_batches(tok, texts, labels, steps, micro, gas, world, max_len, seed):
    """steps·gas global micro-batches; rank r's rows are r·micro … (r+1)·micro of each, exactly the
    rows batches.epoch_batches gives rank r in train.py (same sampler, same order)."""
    need = steps * micro * gas * world
    if len(texts) < need:
        raise SystemExit(f"error: {need} training texts needed (steps {steps} × micro {micro} × accumulation "
                         f"{gas} × world {world}), the split has {len(texts)}")
    ids = tokenize(tok, texts[:need], max_len)
    per_rank = [epoch_batches([len(x) for x in ids], micro, gas, world, r, seed, 0) for r in range(world)]
    return [collate(ids, labels, [i for r in range(world) for i in per_rank[r][k]], tok.pad_token_id)
            for k in range(steps * gas)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CI size: tiny random DistilBERT, 5 steps, micro 4, max_len 32")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 10, --tiny 5)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--config", default=C.DEFAULT_CONFIG)
    ap.add_argument("--micro-batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    ap.add_argument("--max-len", type=int, default=None, help="tokens per text (default 64, --tiny 32)")
    ap.add_argument("--lr", type=float, default=None, help="fills the config's \"auto\" lr (default 1e-4, --tiny 1e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--comm-impl", choices=("primitives", "torch"), default="primitives")
    ap.add_argument("--inject-bug", choices=BUGS, default="none",
                    help="weight_decay_groups: ours decays biases and LayerNorm too (to see a failure)")
    ap.add_argument("--json", default=None, help="also write the rows and verdict here")
    a = ap.parse_args(argv)
    steps = a.steps or (5 if a.tiny else 10)
    max_len = a.max_len or (32 if a.tiny else 64)
    lr = a.lr or (1e-3 if a.tiny else 1e-4)
    if steps < 1 or not 1 <= a.world_size <= 8 or max_len < 4:
        ap.error(f"--steps ≥ 1, --world-size 1..8 and --max-len ≥ 4 expected, got {steps}, {a.world_size}, {max_len}")

    try:
        raw = C.load_config(a.config)
        if a.micro_batch or a.tiny:
            raw["train_micro_batch_size_per_gpu"] = a.micro_batch or 4
        facts = C.RunFacts(world_size=a.world_size, steps_per_epoch=steps, epochs=1, lr=lr, max_steps=steps)
        cfg = C.resolve(raw, facts)
        bundle = D.load()
        tok = M.load_tokenizer(M.offline_model_dir())
    except (C.ConfigError, D.DataError, M.ModelError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg.get("gradient_accumulation_steps", 1)
    batches = make_batches(tok, bundle.train.texts, bundle.train.labels, steps, micro, gas, a.world_size, max_len,
                           a.seed)
    if a.tiny:
        name, init = "parity.distilbert:tiny_model", None  # seeded random init, built once by ds_parity
    else:
        name = "parity.distilbert:full_arch"
        torch.manual_seed(a.seed)  # the classification head is randomly initialised
        full, _, _ = M.load_model(dropout=0.0)
        init = {k: v.detach().clone() for k, v in full.state_dict().items()}
        del full
    ref = Job("deepspeed", name, cfg, steps)
    ours = Job("ours", name, cfg, steps, a.comm_impl, groups="all" if a.inject_bug == "weight_decay_groups" else "split")
    console.print(f"ZeRO-{stage} parity: {'tiny DistilBERT' if a.tiny else 'MiniLM→DistilBERT'}, N={a.world_size}, "
                  f"{steps} steps × micro {micro} × accumulation {gas}, max_len {max_len}, lr {lr:g} "
                  f"({cfg['scheduler']['type'] if cfg.get('scheduler') else 'constant'}), config {a.config}"
                  + (f", [yellow]injected bug: {a.inject_bug}[/]" if a.inject_bug != "none" else ""))
    res = run_parities([(ref, ours)], a.world_size, seed=a.seed, lockstep=True, batches={(name, micro): batches},
                       init_states={name: init} if init is not None else None, timeout=1800.0)[0]
    console.print(render(res, f"DeepSpeed ZeRO-{stage} vs ringzero ZeRO-{stage}, per optimizer step"))
    console.print(f"final parameters: max |Δ| = {res.max_param_diff:.3g}"
                  + (f" in {res.worst_param}" if res.worst_param else "") + f"; tolerances: loss rtol "
                  f"{res.tol.loss_rtol:g}, grad-norm rtol {res.tol.norm_rtol:g}, parameters atol {res.tol.param_atol:.3g}")
    console.print("[dim]expected drift (fp32): gradient pre-division by N, reduction order, bucketed reduce vs "
                  "reduce-scatter, norm summation order, Adam rounding — each ~1 ulp; see this file's docstring.[/]")
    if a.json:
        doc = {"ok": res.ok, "rows": res.rows, "max_param_diff": res.max_param_diff, "tolerance": vars(res.tol),
               "failures": res.failures}
        atomic_write(a.json, lambda f: f.write(json.dumps(doc, indent=1).encode()))
    console.print("[green]PARITY OK[/]" if res.ok else "[red]PARITY FAILED[/]\n" + "\n".join(res.failures))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
