"""The tiny models and synthetic batches every comparison and test trains: one factory each.

    python -c "from zero_from_scratch.engine.models import tiny_distilbert; print(tiny_distilbert())"

tiny_distilbert(): DistilBertForSequenceClassification with dim 32, 2 layers, 2 heads and every
dropout 0 (vocab 101 by default; vocab=30522 for the real tokenizer), the model the ZeRO,
DeepSpeed-parity, classification and benchmark tests use. TinyMLP: Linear → LayerNorm → GELU →
Linear with biases and a LayerNorm, so weight-decay groups are non-trivial, and odd sizes, so
shards are uneven. Cost: construction only (≈ 10k parameters at vocab 101).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import importlib


@dataclass
class Output:
    """The part of an HF ModelOutput the loops need: engine(**batch).loss."""
    loss: torch.Tensor


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 13, hidden: int = 37, classes: int = 3):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, classes)

    def forward(self, x, labels):
        x = x.to(self.fc1.weight.dtype)  # bf16 engines cast the module, not the data
        logits = self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))
        return Output(torch.nn.functional.cross_entropy(logits.float(), labels))


def make_mlp() -> nn.Module:
    return TinyMLP()


def tiny_distilbert(dim: int = 32, n_layers: int = 2, vocab: int = 101, hidden: int | None = None, num_labels: int = 2,
                    max_positions: int = 64, seed: int | None = None) -> nn.Module:
    """DistilBertForSequenceClassification: `dim` wide (FFN `hidden`, default 4·dim), `n_layers`
    layers, 2 heads, GELU, every dropout 0; seeded first when `seed` is given."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification  # optional dependency
    if seed is not None:
        torch.manual_seed(seed)
    cfg = DistilBertConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=2, hidden_dim=hidden or 4 * dim,
                           max_position_embeddings=max_positions, activation="gelu", dropout=0.0,
                           attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=num_labels)
    return DistilBertForSequenceClassification(cfg)


MODELS = {"mlp": make_mlp, "distilbert": tiny_distilbert}


def disable_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def build_model(model: str) -> nn.Module:
    """'mlp', 'distilbert', or 'package.module:factory' (a zero-argument callable), dropout off."""
    if model in MODELS:
        return disable_dropout(MODELS[model]())
    if ":" not in model:
        raise ValueError(f"model must be one of {sorted(MODELS)} or 'package.module:factory', got {model!r}")
    mod, fn = model.split(":", 1)
    return disable_dropout(getattr(importlib.import_module(mod), fn)())


def make_batches(kind: str, n_micro: int, global_micro_bs: int, seed: int = 0, seq: int = 16,
                 vocab: int = 101) -> list[dict]:
    """n_micro global micro-batches (leading dim = global_micro_bs), reproducible from seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        if kind == "mlp":
            out.append({"x": torch.randn(global_micro_bs, 13, generator=g),
                        "labels": torch.randint(0, 3, (global_micro_bs,), generator=g)})
        else:
            ids = torch.randint(1, vocab, (global_micro_bs, seq), generator=g)
            mask = torch.ones_like(ids)
            mask[: global_micro_bs // 2, seq // 2:] = 0  # some padding, so the mask matters
            out.append({"input_ids": ids, "attention_mask": mask,
                        "labels": torch.randint(0, 2, (global_micro_bs,), generator=g)})
    return out


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The usual split: no weight decay for biases and LayerNorm weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
