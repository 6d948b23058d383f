"""Label texts with a checkpoint written by classification/train.py.

    python classification/predict.py --checkpoint runs/classification/best "a gripping, tender film" "a dull mess"

Reads OUTPUT_DIR/best (Hugging Face save_pretrained + ringzero.json), prints one row per text:
the label and its softmax probability. Cost: one forward pass over the texts, no processes.
A LoRA run (train.py --lora R) saves only what it trained, the adapters and the head (peft's
adapter_config.json + adapter_model.safetensors): predict rebuilds the base model named in
ringzero.json (the same loader train.py used), wraps it with the LoRA the checkpoint records
(r, lora_alpha, target_modules, modules_to_save from adapter_config.json) and loads the weights.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from rich.console import Console
from rich.table import Table

from classification.checkpoints import META
from classification.model import ModelError, load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a checkpoint is a local folder: never the network (read by transformers)
ADAPTER = "adapter_config.json"   # peft's record of a LoRA run: r, lora_alpha, target_modules


def load_checkpoint(path: str):
    """(model, tokenizer, meta); a folder not written by train.py, or for another model, is an error."""
    if not os.path.isdir(path):
        raise SystemExit(f"error: --checkpoint {path}: no such folder (train.py writes OUTPUT_DIR/best)")
    f = os.path.join(path, META)
    if not os.path.isfile(f):
        raise SystemExit(f"error: --checkpoint {path} has no {META}: not a checkpoint written by "
                         "classification/train.py (pass OUTPUT_DIR/best)")
    with open(f) as fh:
        meta = json.load(fh)
    if os.path.isfile(os.path.join(path, ADAPTER)) or meta.get("lora"):
        return load_lora_checkpoint(path, meta)
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer   # optional dependency: transformers
    cfg = AutoConfig.from_pretrained(path)
    arch = (cfg.architectures or ["?"])[0]
    if arch != meta.get("architecture") or cfg.num_labels != meta.get("num_labels"):
        raise SystemExit(f"error: --checkpoint {path}: config.json says {arch} with {cfg.num_labels} labels but "
                         f"{META} says {meta.get('architecture')} with {meta.get('num_labels')}: the folder mixes "
                         "two models; retrain or restore it")
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok, meta


def load_lora_checkpoint(path: str, meta: dict):
    """(model, tokenizer, meta) for a LoRA checkpoint: base model + the recorded adapters + head."""
    cfg_file, weights = os.path.join(path, ADAPTER), os.path.join(path, "adapter_model.safetensors")
    missing = [os.path.basename(x) for x in (cfg_file, weights) if not os.path.isfile(x)]
    if missing or not meta.get("lora"):
        raise SystemExit(f"error: --checkpoint {path}: a LoRA checkpoint needs {ADAPTER}, "
                         f"adapter_model.safetensors and \"lora\" in {META}; missing: "
                         f"{missing or [META + ':lora']}: the folder is incomplete; retrain or restore it")
    with open(cfg_file) as fh:
        rec = json.load(fh)
    if rec.get("r") != meta["lora"]:
        raise SystemExit(f"error: --checkpoint {path}: {ADAPTER} says r={rec.get('r')} but {META} says "
                         f"lora={meta['lora']}: the folder mixes two runs; retrain or restore it")
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict   # optional dependency: peft
    from safetensors.torch import load_file   # optional dependency: installed with transformers
    try:
        base, tok, _ = load_model(meta["model"], meta["num_labels"], dropout=0.0)
    except ModelError as e:
        raise SystemExit(f"error: --checkpoint {path}: its base model {meta['model']!r} (from {META}) "
                         f"cannot be loaded: {e}")
    lcfg = LoraConfig(r=rec["r"], lora_alpha=rec["lora_alpha"], lora_dropout=0.0, target_modules=rec["target_modules"],
                      modules_to_save=rec.get("modules_to_save"), task_type=rec.get("task_type"),
                      bias=rec.get("bias", "none"))
    model = get_peft_model(base, lcfg)
    sd = load_file(weights)
    res = set_peft_model_state_dict(model, sd)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]   # adapters + head copies
    unloaded = [n for n in res.missing_keys if n in trained]
    if res.unexpected_keys or unloaded:
        raise SystemExit(f"error: --checkpoint {path}: adapter_model.safetensors does not fit the rebuilt model "
                         f"(unexpected {res.unexpected_keys[:4]}, not loaded {unloaded[:4]}); retrain or restore it")
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        from transformers import AutoTokenizer   # optional dependency: transformers
        tok = AutoTokenizer.from_pretrained(path)
    return model.eval(), tok, meta


def predict(model, tok, meta, texts, max_len=None):
    if not texts or any(not t.strip() for t in texts):
        raise SystemExit("error: give one or more non-empty texts")
    enc = tok(texts, truncation=True, max_length=max_len or meta.get("max_len", 128), padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**enc).logits.softmax(-1)
    names = meta.get("label_names") or [str(i) for i in range(probs.shape[1])]
    return [(names[int(p.argmax())], float(p.max())) for p in probs]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="OUTPUT_DIR/best from classification/train.py")
    ap.add_argument("texts", nargs="+")
    a = ap.parse_args(argv)
    model, tok, meta = load_checkpoint(a.checkpoint)
    rows = predict(model, tok, meta, a.texts)
    t = Table(title=f"{meta.get('model')} fine-tuned on {meta.get('dataset')} (val accuracy {meta.get('val_accuracy', float('nan')):.3f})")
    for c in ("text", "label", "probability"):
        t.add_column(c, justify="right" if c == "probability" else "left")
    for text, (label, p) in zip(a.texts, rows):
        t.add_row(text, label, f"{p:.3f}")
    Console(width=120).print(t)
    return rows


if __name__ == "__main__":
    main()
