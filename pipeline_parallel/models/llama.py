"""A llama-family causal LM as a pipeline layer list, from transformers' LlamaForCausalLM.

    python -m pipeline_parallel.models.llama            # the tiny preset: layers and parameters per layer

    model = llama_model("tiny")                          # offline, random init (seeded), or any LlamaForCausalLM
    net = PipelineModule(layers=llama_layers(model), num_stages=2, loss_fn=llama_loss)

Layers: 0 LlamaEmbedPipe (ids → hidden), 1 … n LlamaBlockPipe (decoder block i−1 with its rotary
tables, causal SDPA), n + 1 LlamaNormPipe, n + 2 LlamaHeadPipe (→ logits); with tie_word_embeddings
the first and last are TiedLayerSpec("embed", …), the head through forward_fn. Each wrapper holds
the HF submodule itself, so state_dict keys are HF's minus "model.layers.i." (convert.py maps them).
Blocks run with attention_mask None, as HF's SDPA path for an unpadded causal batch: one process
gives HF's logits bit for bit (tests/test_pipeline_llm.py). llama_loss: HF's causal-LM loss.
Cost per block and token: ≈ 2·(4h² + 3·h·ffn) FLOPs forward (grouped-query attention has fewer).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pipeline_parallel.engine.layers import TiedLayerSpec
from primitives.log import console

PRESETS = {   # hidden, layers, heads, kv heads, ffn, vocab
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=176, vocab_size=256, max_position_embeddings=256),
    "small": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688, vocab_size=1024, max_position_embeddings=1024),
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096),
}


def llama_config(preset: str = "tiny", **overrides) -> LlamaConfig:
    if preset not in PRESETS:
        raise ValueError(f"llama preset {preset!r} is unknown; allowed: {sorted(PRESETS)}")
    kw = {**PRESETS[preset], "tie_word_embeddings": False, **overrides}
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def llama_model(preset_or_config="tiny", seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A LlamaForCausalLM built offline with random weights (torch.manual_seed(seed) first)."""
    cfg = preset_or_config if isinstance(preset_or_config, LlamaConfig) else llama_config(preset_or_config, **overrides)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


class LlamaEmbedPipe(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    @property
    def weight(self):
        return self.embed_tokens.weight

    def forward(self, ids):
        return self.embed_tokens(ids)


class LlamaBlockPipe(nn.Module):
    """One decoder block; positions 0 … s−1 and the rotary tables are computed here, per call."""

    def __init__(self, layer: nn.Module, config: LlamaConfig):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "rotary", LlamaRotaryEmbedding(config=config))   # buffers only, not saved

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.rotary.inv_freq.device != x.device:
            self.rotary.to(x.device)
        cos_sin = self.rotary(x, position_ids=pos)
        out = self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out


class LlamaNormPipe(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


class LlamaHeadPipe(nn.Module):
    def __init__(self, lm_head: nn.Linear):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, x):
        return self.lm_head(x)


def tied_head(embed: LlamaEmbedPipe, x):
    """The LM head through the tied embedding: logits = x · Eᵀ."""
    return F.linear(x, embed.weight)


def llama_layers(model: LlamaForCausalLM) -> list:
    """The layer list of `model` (its own modules: training the list trains the model)."""
    cfg, m = model.config, model.model
    blocks = [LlamaBlockPipe(layer, cfg) for layer in m.layers]
    if cfg.tie_word_embeddings:
        return ([TiedLayerSpec("embed", LlamaEmbedPipe, m.embed_tokens)] + blocks + [LlamaNormPipe(m.norm)]
                + [TiedLayerSpec("embed", LlamaEmbedPipe, m.embed_tokens, forward_fn=tied_head)])
    return [LlamaEmbedPipe(m.embed_tokens)] + blocks + [LlamaNormPipe(m.norm), LlamaHeadPipe(model.lm_head)]


def llama_loss(logits, labels):
    """HF's causal-LM loss: position t predicts labels[t + 1]; −100 is ignored; mean over the rest."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


if __name__ == "__main__":
    model = llama_model("tiny")
    for i, layer in enumerate(llama_layers(model)):
        mod = layer.build() if isinstance(layer, TiedLayerSpec) else layer
        console.print(f"{i:2d}  {type(mod).__name__:15s} {sum(p.numel() for p in mod.parameters()):10,d} parameters")
