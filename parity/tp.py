"""Tensor parallel vs one process, on the same batch: logits, loss, every gradient, and the
parameters after AdamW steps, as max |difference| (fp32).

    python -m parity.tp                   # tp = 2, 3 × (plain, SP), dp × tp = 2 × 2; a table

Each rank also runs the unsharded model itself (a deep copy taken before `parallelize`), so
the reference is computed independently of every collective. A gradient of a sharded
parameter is compared with the matching slice (`tp_shard`) of the reference gradient; the
parameters after the steps are compared through gather_state_dict. The tiny DistilBERT has
5 heads, FFN width 37 and 101 vocabulary ids, so at tp = 2 and 3 every split is uneven.
With dp > 1 each data-parallel replica takes its slice of the batch and gradients are
averaged over the dp group (ringzero's all-reduce), against the reference on the whole batch.
"""
from __future__ import annotations

import argparse
import copy

import torch
from rich.table import Table

import primitives as P
from primitives.launch import spawn
from primitives.log import console
from primitives.mesh import Mesh
from tensor_parallel.engine.parallelize import parallelize
from tensor_parallel.engine.state_dict import gather_state_dict


def tiny_config(num_labels=3, **kw):
    from transformers import DistilBertConfig   # optional dependency: only the DistilBERT harness needs it
    base = dict(vocab_size=101, dim=20, n_heads=5, hidden_dim=37, n_layers=2, max_position_embeddings=16,
                dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=num_labels, pad_token_id=0)
    base.update(kw)
    return DistilBertConfig(**base)


def batch(seed: int, b: int = 4, s: int = 6, vocab: int = 101, labels: int = 3):
    """(input_ids, attention_mask, labels) with some padding, deterministic in seed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, s - 2:] = 0
    ids[mask == 0] = 0
    return ids, mask, torch.randint(0, labels, (b,), generator=g)


def _slice(ref_t, p):
    if hasattr(p, "tp_shard"):
        d, lo, hi, _ = p.tp_shard
        return ref_t.narrow(d, lo, hi - lo)
    return ref_t


def _maxdiff(a, b) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def run_parity(model, tp_group=None, sequence_parallel=False, dp_group=None, steps=5, lr=1e-3, b=4, s=6, seed=1):
    """Parallelize `model` (a deep copy stays unsharded) and compare. Returns max diffs per quantity."""
    ref = copy.deepcopy(model)
    parallelize(model, tp_group, sequence_parallel=sequence_parallel)
    dp = P.get_comm(dp_group) if dp_group is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    rparams = dict(ref.named_parameters())
    out = {"logits": 0.0, "loss": 0.0, "grads": 0.0, "params": 0.0, "missing grads": 0}
    for step in range(steps):
        ids, mask, labels = batch(seed + step, b * (dp.size if dp else 1), s)
        r = ref(input_ids=ids, attention_mask=mask, labels=labels)
        r.loss.backward()
        if dp:                                        # this replica's slice of the batch
            part = lambda t: t.chunk(dp.size)[dp.rank]  # noqa: E731
            ids, mask, labels = part(ids), part(mask), part(labels)
        o = model(input_ids=ids, attention_mask=mask, labels=labels)
        o.loss.backward()
        if dp:
            for p in model.parameters():
                dp.all_reduce(p.grad, "avg")
        if step == 0:
            rl = r.logits.chunk(dp.size)[dp.rank] if dp else r.logits
            out["logits"] = _maxdiff(o.logits, rl)
            rloss = torch.nn.functional.cross_entropy(rl, labels) if dp else r.loss   # the replica's own slice
            out["loss"] = _maxdiff(o.loss, rloss)
            for name, p in model.named_parameters():
                if p.grad is None or rparams[name].grad is None:
                    out["missing grads"] += 1
                    continue
                out["grads"] = max(out["grads"], _maxdiff(p.grad, _slice(rparams[name].grad, p)))
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    full = gather_state_dict(model)
    rsd = ref.state_dict()
    if set(full) != set(rsd):
        raise AssertionError(f"gather_state_dict names differ: {sorted(set(full) ^ set(rsd))[:5]}")
    out["params"] = max(_maxdiff(full[k], rsd[k]) for k in rsd if rsd[k].is_floating_point())
    return out


def _work(rank, world, dp, tp, sp):
    from transformers import DistilBertForSequenceClassification   # optional dependency
    mesh = Mesh.build(dp=dp, tp=tp)
    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(tiny_config())
    return run_parity(model, mesh.tp_group, sp, mesh.dp_group if dp > 1 else None)


def main(argv=None) -> None:
    argparse.ArgumentParser(description="tensor parallel vs one process: a table of max differences").parse_args(argv)
    t = Table(title="tensor parallel vs one process: max |difference| over all ranks (tiny DistilBERT, fp32, 5 AdamW steps)")
    for c in ("dp × tp", "sequence parallel", "logits", "loss", "every gradient", "params after 5 steps"):
        t.add_column(c, justify="right")
    for dp, tp, sp in ((1, 2, False), (1, 2, True), (1, 3, False), (1, 3, True), (2, 2, False), (2, 2, True)):
        res = spawn(_work, dp * tp, args=(dp, tp, sp), timeout=600)
        worst = {k: max(r[k] for r in res) for k in res[0]}
        t.add_row(f"{dp} × {tp}", "yes" if sp else "no", *(f"{worst[k]:.1e}" for k in ("logits", "loss", "grads", "params")))
    console.print(t)


if __name__ == "__main__":
    main()
