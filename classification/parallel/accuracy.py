"""The pretrained DistilBERT classifier sharded with tp = N predicts what it predicts unsharded.

    python -m classification.parallel.accuracy                      # the whole test split, tp = 2 and 3
    python -m classification.parallel.accuracy --rows 128 --tp 2    # a slice, one layout

1. One process: the offline pretrained classifier (classification.model.load_offline_model:
   MiniLM encoder mapped onto DistilBERT, dropout off). Its pre_classifier/classifier head is
   random, which makes accuracy meaningless (≈ chance), so the head alone is fine-tuned first on
   frozen [CLS] features of --train-rows training rows (one encoder forward per row, no encoder
   gradients, --epochs of AdamW on a 384 → 384 → 2 head: seconds, not an epoch of the encoder).
2. The same process evaluates the whole TEST split of classification/data.py (the stratified
   split, so no test row was ever trained on) unsharded: fp32 logits.
3. spawn(tp) fresh ranks load the same weights (+ the fine-tuned head), parallelize() them over
   the world and evaluate the same rows in the same batches; every rank's logits are compared
   with the one-process logits: accuracy both ways, rows whose predicted class differs (must be
   0), max |Δlogit|, and the smallest margin |l₁ − l₀| of the reference (a prediction can only
   flip where the margin is below the logit difference).

Cost per evaluated batch of b rows × s tokens, per rank: the forward TP traffic of
formulas.distilbert_traffic (2 all-reduces of b·s·h per layer + 1 for the embedding), 1/tp of
the sharded weights. Rows are batched by length (sorted) so padding stays small.
"""
from __future__ import annotations

import argparse
import time

import torch
from rich.table import Table

from classification import data as D
from classification.model import load_offline_model
from primitives.launch import spawn
from primitives.log import console
from tensor_parallel.engine.parallelize import parallelize

HEAD = ("pre_classifier", "classifier")


def predict(model, tok, texts, batch: int = 64, max_len: int = 128) -> torch.Tensor:
    """fp32 logits of `texts` in their order; batches of similar length (the same on every side)."""
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    out = torch.empty(len(texts), model.config.num_labels)
    model.eval()
    with torch.no_grad():
        for k in range(0, len(order), batch):
            idx = order[k:k + batch]
            enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
            out[idx] = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.float()
    return out


def finetune_head(model, tok, texts, labels, epochs: int = 30, lr: float = 1e-3, seed: int = 0) -> dict:
    """Train pre_classifier + classifier on frozen [CLS] hidden states; return the head's state."""
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    feats = torch.empty(len(texts), model.config.dim)
    model.eval()
    with torch.no_grad():
        for k in range(0, len(order), 64):
            idx = order[k:k + 64]
            enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=128, return_tensors="pt")
            feats[idx] = model.distilbert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[:, 0]
    y = torch.tensor(labels)
    head = [getattr(model, n) for n in HEAD]
    params = [p for m in head for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(32):
            logits = model.classifier(torch.relu(model.pre_classifier(feats[idx])))
            torch.nn.functional.cross_entropy(logits, y[idx]).backward()
            opt.step()
            opt.zero_grad()
    return {f"{n}.{k}": v.detach().clone() for n in HEAD for k, v in getattr(model, n).state_dict().items()}


def load_classifier(num_labels: int, head: dict | None = None):
    """(model, tokenizer): the offline pretrained DistilBERT, dropout off, with `head` loaded."""
    torch.manual_seed(0)
    model, tok = load_offline_model(num_labels=num_labels, dropout=0.0)
    if head is not None:
        res = model.load_state_dict(head, strict=False)
        if res.unexpected_keys:
            raise ValueError(f"head state has unknown keys {res.unexpected_keys}")
    return model.eval(), tok


def _sharded(rank, world, num_labels, head, texts):
    model, tok = load_classifier(num_labels, head)
    parallelize(model)
    return predict(model, tok, texts)


def compare(ref: torch.Tensor, got: torch.Tensor, labels) -> dict:
    y = torch.tensor(labels)
    top2 = ref.topk(2, dim=1).values
    return {"acc ref": (ref.argmax(1) == y).float().mean().item(), "acc": (got.argmax(1) == y).float().mean().item(),
            "differ": int((ref.argmax(1) != got.argmax(1)).sum()), "max dlogit": (ref - got).abs().max().item(),
            "max logit": ref.abs().max().item(), "min margin": (top2[:, 0] - top2[:, 1]).min().item()}


def reference(rows: int | None = None, train_rows: int = 2000, epochs: int = 30) -> dict:
    """Steps 1-2 in this process: the head fine-tuned, and the unsharded logits of the test rows."""
    bundle = D.load()
    texts, labels = bundle.test.texts[:rows], bundle.test.labels[:rows]
    model, tok = load_classifier(bundle.num_labels)
    head = finetune_head(model, tok, bundle.train.texts[:train_rows], bundle.train.labels[:train_rows], epochs)
    return {"head": head, "texts": texts, "labels": labels, "logits": predict(model, tok, texts),
            "num_labels": bundle.num_labels, "test rows": len(bundle.test)}


def sharded(spawn, n: int, ref: dict) -> list[dict]:
    """Step 3: compare() for every rank of a tp = n world (spawn: primitives.launch.spawn or the
    tests' fixture)."""
    res = spawn(_sharded, n, args=(ref["num_labels"], ref["head"], ref["texts"]), timeout=1200)
    return [compare(ref["logits"], r, ref["labels"]) for r in res]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="2,3", help="comma-separated tensor-parallel sizes (12 heads: up to 12)")
    ap.add_argument("--rows", type=int, default=None, help="first ROWS of the test split (default: all)")
    ap.add_argument("--train-rows", type=int, default=2000, help="training rows for the head-only fine-tune")
    ap.add_argument("--epochs", type=int, default=30, help="head-only fine-tune epochs over those rows")
    a = ap.parse_args(argv)
    tps = [int(x) for x in a.tp.split(",")]
    bad = [n for n in tps if not 1 <= n <= 12]
    if bad or (a.rows is not None and a.rows < 1) or a.train_rows < 2 or a.epochs < 1:
        ap.error(f"--tp sizes must be 1..12 (12 heads), got {bad or tps}; --rows, --epochs ≥ 1; --train-rows ≥ 2")
    t0 = time.perf_counter()
    ref = reference(a.rows, a.train_rows, a.epochs)
    res = {n: sharded(spawn, n, ref) for n in tps}
    t = Table(title=f"offline DistilBERT (MiniLM weights, head fine-tuned on {a.train_rows} train rows), "
                    f"{len(ref['texts'])} of {ref['test rows']} test rows, fp32: sharded vs one process")
    for c in ("tp", "rank", "accuracy 1 process", "accuracy sharded", "rows predicted differently",
              "max |Δlogit|", "max |logit|", "min margin"):
        t.add_column(c, justify="right")
    for n, per_rank in res.items():
        for rank, r in enumerate(per_rank):
            t.add_row(str(n), str(rank), f"{r['acc ref']:.4f}", f"{r['acc']:.4f}", str(r["differ"]),
                      f"{r['max dlogit']:.1e}", f"{r['max logit']:.2f}", f"{r['min margin']:.1e}")
    console.print(t)
    console.print(f"{time.perf_counter() - t0:.0f} s on {__import__('os').cpu_count()} shared cores, torch {torch.__version__}")


if __name__ == "__main__":
    main()
