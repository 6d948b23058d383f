"""Label texts with a checkpoint written by classification/train.py.

    python classification/predict.py --checkpoint runs/classification/best "a gripping, tender film" "a dull mess"

Reads OUTPUT_DIR/best (Hugging Face save_pretrained + ringzero.json), prints one row per text:
the label and its softmax probability. Cost: one forward pass over the texts, no processes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a checkpoint is a local folder: never the network

META = "ringzero.json"


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
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    cfg = AutoConfig.from_pretrained(path)
    arch = (cfg.architectures or ["?"])[0]
    if arch != meta.get("architecture") or cfg.num_labels != meta.get("num_labels"):
        raise SystemExit(f"error: --checkpoint {path}: config.json says {arch} with {cfg.num_labels} labels but "
                         f"{META} says {meta.get('architecture')} with {meta.get('num_labels')}: the folder mixes "
                         "two models; retrain or restore it")
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok, meta


def predict(model, tok, meta, texts, max_len=None):
    import torch
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
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{meta.get('model')} fine-tuned on {meta.get('dataset')} (val accuracy {meta.get('val_accuracy', float('nan')):.3f})")
    for c in ("text", "label", "probability"):
        t.add_column(c, justify="right" if c == "probability" else "left")
    for text, (label, p) in zip(a.texts, rows):
        t.add_row(text, label, f"{p:.3f}")
    Console(width=120).print(t)
    return rows


if __name__ == "__main__":
    main()
