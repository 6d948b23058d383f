"""Chapter 07's picture: learning rate and training loss of the default classification run,
with the validation accuracy per epoch, read from the run's own metrics.jsonl.

    python -m figures.ch07_lr_loss                       # runs the default demo if no JSONL yet (~9 min)
    python -m figures.ch07_lr_loss --metrics runs/classification/metrics.jsonl
    RINGZERO_CLASSIFICATION_RUN=DIR python -m figures    # read (or train into) DIR instead

The default run is `make demo` = `deepspeed --num_gpus 2 classification/train.py`; its JSONL is
written to runs/classification/. Nothing here is re-computed: the curves are what the run logged.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from figures.common import ROOT, pyplot, save
from primitives.launch import free_port

DEFAULT = os.path.join(os.environ.get("RINGZERO_CLASSIFICATION_RUN") or os.path.join(ROOT, "runs", "classification"),
                       "metrics.jsonl")


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_default(out_dir: str) -> str:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "classification/train.py",
           "--output-dir", out_dir]
    print("no metrics yet; running the default demo:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return os.path.join(out_dir, "metrics.jsonl")


def draw(path: str) -> str:
    recs = read(path)
    train = [r for r in recs if r.get("event") == "train"]
    evals = [r for r in recs if r.get("event") == "eval"]
    test = [r for r in recs if r.get("event") == "test"]
    if not train:
        raise SystemExit(f"{path} has no train records")
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [r["step"] for r in train]
    lr = [r["lr"][0] if isinstance(r["lr"], list) else r["lr"] for r in train]
    ax1.plot(steps, lr, color="#4c72b0")
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("learning rate")
    ax1.set_title("WarmupDecayLR as the run applied it")
    ax2.plot(steps, [r["loss"] for r in train], color="#dd8452", label="train loss (mean of last 10)")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("loss")
    ax3 = ax2.twinx()
    if evals:
        ax3.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", color="#55a868",
                 label="validation accuracy")
    if test:
        ax3.axhline(test[-1]["test_accuracy"], ls="--", color="#55a868", lw=1,
                    label=f"test accuracy {test[-1]['test_accuracy']:.3f}")
    ax3.set_ylabel("accuracy")
    lines = ax2.get_legend_handles_labels()
    more = ax3.get_legend_handles_labels()
    ax2.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="center right")
    ax2.set_title("loss and accuracy")
    fig.suptitle("The default DistilBERT run (deepspeed --num_gpus 2 classification/train.py)")
    return save(fig, "07_lr_loss", "figures.ch07_lr_loss", note=f"from {os.path.relpath(path, ROOT)}")


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", default=None, help=f"a metrics.jsonl (default {os.path.relpath(DEFAULT, ROOT)})")
    a = ap.parse_args(argv if argv is not None else [])
    path = a.metrics or (DEFAULT if os.path.exists(DEFAULT) else run_default(os.path.dirname(DEFAULT)))
    return [draw(path)]


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(p)
