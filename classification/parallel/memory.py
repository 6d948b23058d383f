"""Activation and parameter memory per rank, measured, against Megatron-SP's formulas.

    python -m classification.parallel.memory [--b 4 --s 64]          # spawns tp = 1, 2, 4 itself

Activations: what autograd saves for backward inside the transformer layers, counted with
torch.autograd.graph.saved_tensors_hooks (each storage once, parameters excluded), for a DistilBERT-base-shaped
layer stack (h = 384, a = 12 heads, FFN 1536) in bf16 with dropout 0.1 and eager attention, so
Megatron's assumptions hold: 2-byte activations, 1-byte dropout masks, softmax stored.
Formula (Korthikanti et al. 2022, eq. 2-5), per layer: s·b·h·(34 + 5as/h) for one rank,
s·b·h·(10 + 24/t + 5as/(ht)) with TP, s·b·h·(34 + 5as/h)/t with TP + SP.
Measured / formula is the same 1.03-1.05 in every row, tp = 1 included: a constant of the
HF DistilBERT block (e.g. it has no dropout after the attention projection, Megatron's GPT
block does), not of the parallelism. With SP the inputs of Q/K/V and lin1 are saved as the
sequence shard (2·2sbh/t) and all-gathered again in backward (comm.SeqParallelLinear, as
Megatron-SP does), so SP lands on the formula's 1/t. Saving the gathered input instead measures
1.32× (t = 2) and 1.68× (t = 4) the formula: it is a sequence-major view of the gather buffer,
so Q, K, V and lin1 each save their own contiguous copy of it, 4·2sbh bytes per layer instead
of 2·2sbh/t, which accounts for the whole gap at both t.
Parameters: bytes held vs tensor_parallel.engine.formulas.distilbert_params.
"""
from __future__ import annotations

import argparse

import torch
from rich.table import Table

from classification.model import distilbert_config
from primitives.launch import spawn
from primitives.log import console
from tensor_parallel.engine.formulas import distilbert_params, megatron_activation_bytes
from tensor_parallel.engine.parallelize import parallelize


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """`with SavedBytes(model) as c: loss = model(x)` → c.bytes: what autograd saved for backward,
    each storage once, the model's parameters (weights saved by linear layers) excluded.
    c.active[0] = False pauses counting (to count inside chosen modules only)."""

    def __init__(self, model, active: bool = True):
        self.seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes, self.active = 0, [active]
        super().__init__(self._pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, t):
        if self.active[0]:
            key = t.untyped_storage().data_ptr()
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return t


def measure(b: int, s: int, tp_group=None, sequence_parallel: bool = False, layers: int = 2):
    """(activation bytes per layer, parameter bytes) on this rank."""
    from transformers import DistilBertForSequenceClassification   # optional dependency (extras: deepspeed)
    torch.manual_seed(0)
    cfg = distilbert_config(num_labels=2, dropout=0.1)
    cfg.n_layers = layers
    cfg._attn_implementation = "eager"
    model = DistilBertForSequenceClassification(cfg).to(torch.bfloat16).train()
    if tp_group is not False:
        parallelize(model, tp_group, sequence_parallel=sequence_parallel)
    for blk in model.distilbert.transformer.layer:        # count inside the transformer layers only
        blk.register_forward_pre_hook(lambda *a: counter.active.__setitem__(0, True))
        blk.register_forward_hook(lambda *a: counter.active.__setitem__(0, False))
    ids = torch.randint(1, 30000, (b, s), generator=torch.Generator().manual_seed(0))
    with SavedBytes(model, active=False) as counter:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.zeros(b, dtype=torch.long))
    out.loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return counter.bytes / layers, params


def _work(rank, n, b, s):
    rows = []
    for sp in ((False, True) if n > 1 else (False,)):
        rows.append((sp, *measure(b, s, None if n > 1 else False, sp)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--s", type=int, default=64)
    ap.add_argument("--tp", default="1,2,4")
    a = ap.parse_args(argv)
    cfg = distilbert_config()
    h, heads = cfg.dim, cfg.n_heads
    t = Table(title=f"activation bytes per layer and rank: DistilBERT-base shape (h={h}, a={heads}), "
                    f"b={a.b}, s={a.s}, bf16, dropout 0.1 — measured vs Megatron-SP's formula")
    for c in ("tp", "SP", "measured MiB", "formula MiB", "measured / formula", "vs tp=1 measured",
              "vs tp=1 formula", "param MiB (rank 0)", "= formula"):
        t.add_column(c, justify="right")
    base = None
    for n in [int(x) for x in a.tp.split(",")]:
        res = spawn(_work, n, args=(a.b, a.s), timeout=600)
        for sp, act, params in res[0]:
            f = megatron_activation_bytes(a.s, a.b, h, heads, n, sp)
            if base is None:
                base = (act, f)
            cfg.n_layers = 2
            pf = distilbert_params(cfg, n, 0) * 2
            t.add_row(str(n), "yes" if sp else "no", f"{act / 2**20:.2f}", f"{f / 2**20:.2f}", f"{act / f:.3f}",
                      f"{act / base[0]:.3f}", f"{f / base[1]:.3f}", f"{params / 2**20:.2f}",
                      "yes" if params == pf else f"no ({pf / 2**20:.2f})")
    console.print(t)


if __name__ == "__main__":
    main()
