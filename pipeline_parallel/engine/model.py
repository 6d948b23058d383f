"""A small GPT-style stack written as a pipeline layer list (built from numbers, offline).

    python -m pipeline_parallel.engine.model          # the layer list and parameters per layer

    [TiedLayerSpec("embed", Embed), Block × n_layers, LayerSpec(FinalNorm), TiedLayerSpec("embed", head)]

The token embedding is tied to the output head (GPT-2's weight tying: the case DeepSpeed's
TiedLayerSpec exists for); every layer maps one tensor to one, so any contiguous cut is a stage;
no dropout, so runs are deterministic for parity tests.
Cost per block and token: ≈ 24·h² FLOPs forward (attention projections 8h², MLP 16h²).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline_parallel.engine.module import LayerSpec, PipelineModule, TiedLayerSpec, layer_name
from primitives.log import console


class Embed(nn.Module):
    """Token + learned position embedding. `weight` is the token table (the tied attribute)."""

    def __init__(self, vocab: int, dim: int, max_len: int = 128):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)

    def forward(self, ids):
        return self.weight[ids] + self.pos[: ids.shape[1]]


def head(embed: Embed, x):
    """The output head: logits = x · Eᵀ, with the embedding's table."""
    return x @ embed.weight.T


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4h MLP, residuals around both."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no q/k/v bias: the key bias's gradient is exactly zero in exact arithmetic (softmax ignores a
        # constant added to every score), so in floats it is pure rounding noise that Adam's
        # g/(√v + ε) blows up to lr-sized steps — parity tests would compare noise
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class FinalNorm(nn.LayerNorm):
    pass


def gpt_layers(vocab: int = 97, dim: int = 32, n_layers: int = 4, heads: int = 2, max_len: int = 64) -> list:
    return ([TiedLayerSpec("embed", Embed, vocab, dim, max_len)]
            + [LayerSpec(Block, dim, heads) for _ in range(n_layers)]
            + [LayerSpec(FinalNorm, dim), TiedLayerSpec("embed", Embed, vocab, dim, max_len, forward_fn=head)])


def lm_loss(logits, labels):
    """Mean next-token cross-entropy over every position of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


if __name__ == "__main__":
    pm = PipelineModule(gpt_layers(), num_stages=2, loss_fn=lm_loss)
    for i, (spec, n) in enumerate(zip(pm.layers, pm.param_counts())):
        console.print(f"{i:2d}  {layer_name(spec):10s} {n:8,d} parameters")
    console.print(f"2 stages by parameters: boundaries {pm.parts}")
