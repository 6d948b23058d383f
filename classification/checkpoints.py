"""What classification/train.py writes and reads back: OUTPUT_DIR/best and the ringzero.json beside it.

    torchrun --standalone --nproc_per_node 2 classification/train.py --engine zero   (writes OUTPUT_DIR/best)
    python classification/predict.py --checkpoint OUTPUT_DIR/best "a gripping film"  (reads it)

best/ is a Hugging Face save_pretrained folder (or peft's adapters with --lora), whole: the weights
are gathered first (engine.full_parameters; --tp also gathers the shards), so predict.py and any
later run load it alike. ringzero.json records the model, labels, dataset and engine; a checkpoint
of another run is refused (check_meta), not silently mixed in.
Cost: one gather of the weights per save and per load (ZeRO-3: an all-gather of Ψ).
"""
from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

META = "ringzero.json"


def save_best(engine, tok, out_dir, meta, rank, tp=None):
    """OUTPUT_DIR/best: Hugging Face save_pretrained + ringzero.json, written to a temporary folder
    and renamed, so a crash never leaves a half-written best checkpoint. Every rank enters (ZeRO-3
    gathers the weights; --tp gathers the shards into the full state dict); rank 0 writes."""
    with engine.full_parameters():
        sd = tp.full_state_dict(engine.module) if tp else None
        if rank == 0:
            _write_best(engine.module, tok, out_dir, meta, sd)
    if dist.is_initialized():
        dist.barrier()


def _write_best(model, tok, out_dir, meta, state_dict=None):
    final, tmp, old = (os.path.join(out_dir, n) for n in ("best", "best.tmp", "best.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
    if os.path.isdir(final):               # moved aside, not deleted, until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def check_meta(path, meta, what):
    """A checkpoint written for another model / dataset / engine is an error, not a silent mix."""
    f = os.path.join(path, META)
    if not os.path.isfile(f):
        raise SystemExit(f"error: {path} has no {META}: not a checkpoint written by classification/train.py")
    with open(f) as fh:
        have = json.load(fh)
    have.setdefault("tp", 1)              # a ringzero.json without "tp" describes an unsharded model
    diff = {k: (have.get(k), meta[k]) for k in what if have.get(k) != meta[k]}
    if diff:
        raise SystemExit(f"error: checkpoint {path} belongs to another run: " +
                         ", ".join(f"{k} is {h!r} there, {w!r} here" for k, (h, w) in diff.items()))
    return have


def load_best(engine, best, meta, tp=None) -> None:
    """Put OUTPUT_DIR/best back into the engine's model on every rank (collective: every rank calls it)."""
    from safetensors.torch import load_file   # optional dependency: installed with transformers
    with engine.full_parameters(modify=True):  # ZeRO-3: rank 0's loaded weights go back into every shard
        if meta.get("lora"):  # peft saved the adapters and the head only
            from peft import set_peft_model_state_dict   # optional dependency: the `recipes` extra
            set_peft_model_state_dict(engine.module, load_file(os.path.join(best, "adapter_model.safetensors")))
        elif tp:  # best is unsharded: each rank narrows it to its own slices
            tp.load_full(engine.module, load_file(os.path.join(best, "model.safetensors")))
        else:
            engine.module.load_state_dict(load_file(os.path.join(best, "model.safetensors")))
