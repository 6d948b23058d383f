"""A transformer's shape, its parameter count and its FLOPs per step, from presets, a Hugging
Face config.json or explicit arguments.

    python -m planner llama-7b --gpus 8 --hardware a100

FLOPs per token, forward + backward (Narayanan et al., SC21, arXiv 2104.04473, eq. 3, and
Megatron-LM's `num_floating_point_operations` at core_r0.8.0, which produced the README's H100
MFU figures): 2 FLOPs per multiply-add, backward = 2 × forward, so 6 × (linear weights) per
token, plus attention's QK^T and softmax·V, 4·s·h forward per layer (counted over the full s×s
square, as both sources count it), plus the logits 2·h·V. For GPT (MLP 4h, MHA):
    F = 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h))          model FLOPs (what MFU divides)
and with full activation recomputation (one more forward per layer, not the logits):
    F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))          the paper's hardware count
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Model:
    """One dense decoder (or encoder) stack. Sizes in elements."""
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int                       # default sequence length (the CLI's --seq overrides it)
    ffn: int = 0                   # MLP width; 0 → 4·hidden
    kv_heads: int = 0              # grouped-query attention; 0 → heads
    gated: bool = False            # SwiGLU: three MLP matrices instead of two
    bias: bool = True              # GPT/BERT biases; llama has none
    tied: bool = True              # output layer shares the input embedding
    positions: int = 0             # learned position embeddings (GPT/BERT); 0 → rotary
    family: str = ""               # the layer torch runs on a CPU host (planner.memory): "" GPT's pre-norm
                                   # nn.TransformerEncoderLayer (llama's decoder layer when gated),
                                   # "distilbert" Hugging Face's post-norm DistilBERT block, eager attention
    source: str = field(default="", compare=False)   # where the shape comes from

    def __post_init__(self):
        bad = [f"{k} {getattr(self, k)}" for k in ("layers", "hidden", "heads", "vocab", "seq") if getattr(self, k) < 1]
        bad += [f"{k} {getattr(self, k)}" for k in ("ffn", "kv_heads", "positions") if getattr(self, k) < 0]
        if bad:
            raise ValueError(f"{self.name}: sizes must be positive ({', '.join(bad)})")
        if self.heads % self.kv:
            raise ValueError(f"{self.name}: heads {self.heads} is not a multiple of kv heads {self.kv}")
        if self.hidden % self.heads:
            raise ValueError(f"{self.name}: hidden {self.hidden} is not a multiple of heads {self.heads}")

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def layer_linear_params(self) -> int:
        """Weights of one layer's matrices (what the matmuls multiply by)."""
        h, hd = self.hidden, self.hidden // self.heads
        attn = h * h + 2 * h * self.kv * hd + h * h          # q, k, v, o
        mlp = (3 if self.gated else 2) * h * self.f
        return attn + mlp

    def layer_params(self) -> int:
        h, hd = self.hidden, self.hidden // self.heads
        small = 2 * h * (2 if self.bias else 1)              # two norms (weight, + bias)
        if self.bias:
            small += h + 2 * self.kv * hd + h + self.f * (2 if self.gated else 1) + h
        return self.layer_linear_params() + small

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_params(self) -> int:
        """The output layer's own weights (0 when tied) and the final norm."""
        return (0 if self.tied else self.vocab * self.hidden) + self.hidden * (2 if self.bias else 1)

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def flops_per_token(self, seq: int, recompute_layers: bool = False) -> float:
        """Forward + backward FLOPs per token (module docstring). recompute_layers: one more
        forward of every layer (full activation recomputation), as the paper's hardware count."""
        fwd_layer = 2 * self.layer_linear_params() + 4 * seq * self.hidden
        passes = 4 if recompute_layers else 3
        return self.layers * passes * fwd_layer + 3 * 2 * self.hidden * self.vocab


def gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048, source: str = "") -> Model:
    return Model(name, layers, hidden, heads, vocab, seq, positions=seq, source=source)


def llama(name, layers, hidden, heads, ffn, kv_heads=0, vocab=32000, seq=4096, source=""):
    return Model(name, layers, hidden, heads, vocab, seq, ffn=ffn, kv_heads=kv_heads, gated=True,
                 bias=False, tied=False, source=source)


_NAR = "Narayanan et al. SC21 Table 1 (arXiv 2104.04473); Megatron-LM README of 2021-04-08, images/cases_april2021.png"
_LLAMA = "Touvron et al. 2023 (Llama 2), the Hugging Face config.json of each model"
PRESETS: dict[str, Model] = {m.name: m for m in [
    llama("llama-7b", 32, 4096, 32, 11008, source=_LLAMA),
    llama("llama-13b", 40, 5120, 40, 13824, source=_LLAMA),
    llama("llama-70b", 80, 8192, 64, 28672, kv_heads=8, source=_LLAMA),
    gpt("gpt3-175b", 96, 12288, 96, vocab=50257, seq=2048, source="Brown et al. 2020, Table 2.1"),
    *[gpt(f"gpt-{n}", L, h, a, source=_NAR) for n, L, h, a in [
        ("1.7b", 24, 2304, 24), ("3.6b", 30, 3072, 32), ("7.5b", 36, 4096, 32), ("18b", 40, 6144, 48),
        ("39b", 48, 8192, 64), ("76b", 60, 10240, 80), ("145b", 80, 12288, 96), ("310b", 96, 16384, 128),
        ("530b", 105, 20480, 128), ("1t", 128, 25600, 160)]],
    Model("bert-base", 12, 768, 12, 30522, 512, positions=512, source="Devlin et al. 2019"),
    Model("bert-large", 24, 1024, 16, 30522, 512, positions=512, source="Devlin et al. 2019"),
    Model("distilbert", 6, 768, 12, 30522, 128, ffn=3072, positions=512, source="Sanh et al. 2019 (distilbert-base)"),
    Model("tiny", 2, 64, 4, 1000, 32, positions=32, source="a toy for tests"),
]}


def from_hf_config(path: str) -> Model:
    """A Hugging Face config.json: llama/mistral/qwen (num_hidden_layers, intermediate_size,
    num_key_value_heads), GPT-2 (n_layer, n_embd, n_head), BERT, DistilBERT (n_layers, dim)."""
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a Hugging Face config.json ({e})") from e
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return from_config_dict(c, name or (c.get("model_type") if isinstance(c, dict) else "") or "config",
                            os.path.abspath(path))


def from_hub(repo_id: str) -> Model:
    """A model's config.json from the Hugging Face hub (or its local cache), as transformers'
    AutoConfig reads it, e.g. meta-llama/Llama-2-7b-hf."""
    try:
        from transformers import AutoConfig      # only for a hub name: the planner needs no transformers otherwise
        c = AutoConfig.from_pretrained(repo_id).to_dict()
    except Exception as e:      # noqa: BLE001  (offline, unknown repository, gated, no transformers: one message)
        raise ValueError(f"model {repo_id!r} is not a preset or a file here, and its config could not be read from "
                         f"the Hugging Face hub or its cache ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                         "pass its config.json or a folder holding it") from e
    return from_config_dict(c, repo_id.rsplit("/", 1)[-1], f"hub:{repo_id}")


def from_config_dict(c, name: str, source: str) -> Model:
    """A Model from a config's fields (from_hf_config's and from_hub's shared reading)."""
    if not isinstance(c, dict):
        raise ValueError(f"{source}: a config.json holds a JSON object, got {type(c).__name__}")
    g = lambda *keys, default=None: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
    L, h = g("num_hidden_layers", "n_layer", "n_layers"), g("hidden_size", "n_embd", "dim", "d_model")
    a, V = g("num_attention_heads", "n_head", "n_heads"), g("vocab_size")
    if None in (L, h, a, V):
        raise ValueError(f"{source}: need layers, hidden size, heads and vocab_size; found {L}, {h}, {a}, {V}")
    kind = c.get("model_type", "")
    gated = kind in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2") or c.get("hidden_act") == "silu"
    npos = g("max_position_embeddings", "n_positions", "n_ctx", default=2048)
    ffn, kv = g("intermediate_size", "n_inner", "hidden_dim", default=0), g("num_key_value_heads", default=0)
    for key, v in (("layers", L), ("hidden size", h), ("heads", a), ("vocab_size", V), ("positions", npos), ("ffn", ffn),
                   ("num_key_value_heads", kv)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{source}: {key} must be an integer, found {v!r}")
    # rotary: the rope fields (transformers 5 writes rope_parameters), GPT-NeoX/GPT-J's rotary_pct/rotary_dim, or gated
    rotary = gated or c.get("position_embedding_type") == "rotary" or any(
        k in c for k in ("rope_theta", "rope_scaling", "rope_parameters", "rotary_pct", "rotary_dim", "rotary_emb_base"))
    return Model(name=name, layers=L, hidden=h, heads=a, vocab=V, seq=min(npos, 4096),
                 ffn=ffn, kv_heads=kv, gated=gated,
                 bias=not gated,
                 tied=bool(c.get("tie_word_embeddings", not gated)), positions=0 if rotary else npos,
                 source=source)


def resolve(name: str | None, **shape) -> Model:
    """A preset, a config.json path (or its folder), a hub name, or explicit --layers/--hidden/--heads/--vocab/--seq."""
    explicit = {k: v for k, v in shape.items() if v is not None}
    if name and name in PRESETS:
        m = PRESETS[name]
    elif name and os.path.exists(name):
        m = from_hf_config(os.path.join(name, "config.json") if os.path.isdir(name) else name)
    elif name and name.strip("/").count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith(".json"):
        m = from_hub(name.strip("/"))      # org/name: the hub's (a missing local file stays "unknown" below)
    elif name and name != "custom":
        raise ValueError(f"unknown model {name!r}: a preset ({', '.join(PRESETS)}), a config.json, a Hugging Face "
                         "hub name (org/name), or 'custom' with --layers --hidden --heads --vocab")
    else:
        need = {"layers", "hidden", "heads", "vocab"} - explicit.keys()
        if need:
            raise ValueError(f"a custom model needs --{' --'.join(sorted(need))}")
        return Model("custom", explicit.pop("layers"), explicit.pop("hidden"), explicit.pop("heads"),
                     explicit.pop("vocab"), explicit.pop("seq", 2048), **explicit, source="command line")
    return replace(m, **explicit) if explicit else m
