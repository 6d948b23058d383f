"""Run the seq2seq recipe under each configuration and print peak memory per rank, side by side.

    python -m seq2seq.memory_table                    # 4 runs × ~3-10 min on 2 cores
    python -m seq2seq.memory_table --steps 100 --only zero    # a quick look

Configurations (2 ranks each, launched as a user would, free ports): ours and DeepSpeed, each at
ZeRO-1 (seq2seq/ds_config_zero1.json) and ZeRO-3 + optimizer offload (ds_config_zero3_offload.json:
nvme for ours, cpu for DeepSpeed, whose nvme needs libaio). Peak RSS is VmHWM per rank: it includes
the Python/torch runtime (~0.3-0.4 GiB per process), so the model-state differences of a 0.7 M-param
T5 are small next to it; the DistilBERT-base numbers are in benchmarks/offload_memory.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from rich.table import Table

from primitives.launch import free_port
from primitives.log import console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [("zero", "ds_config_zero1.json"), ("zero", "ds_config_zero3_offload.json"),
           ("deepspeed", "ds_config_zero1.json"), ("deepspeed", "ds_config_zero3_offload.json")]


def launch(engine: str, config: str, out: str, steps: int) -> dict:
    py = os.path.dirname(sys.executable)
    port = free_port()
    cfg = os.path.join(ROOT, "seq2seq", config)
    if engine == "deepspeed":
        cmd = [os.path.join(py, "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]
    else:
        cmd = [os.path.join(py, "torchrun"), "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += [os.path.join(ROOT, "seq2seq", "train.py"), "--engine", engine, "--config", cfg, "--steps", str(steps),
            "--output-dir", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"{engine} {config} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if '"final"' in x][-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--only", choices=("zero", "deepspeed"), default=None)
    a = ap.parse_args(argv)
    t = Table(title=f"seq2seq T5 (0.7 M params), 2 ranks × 1 thread, {a.steps} steps, torch {torch.__version__}, "
                    "2 shared CPU cores")
    for c in ("configuration", "held-out exact match", "train s", "peak RSS rank 0 (MiB)", "rank 1 (MiB)"):
        t.add_column(c, justify="right")
    with tempfile.TemporaryDirectory(prefix="seq2seq-table-") as d:
        for i, (engine, cfg) in enumerate(CONFIGS):
            if a.only and engine != a.only:
                continue
            r = launch(engine, cfg, os.path.join(d, str(i)), a.steps)
            t.add_row(r["config"], f"{r['exact_match']:.3f}", f"{r['train_s']:.0f}",
                      *[f"{x / 2**20:,.0f}" for x in r["peak_rss_per_rank"]])
    console.print(t)


if __name__ == "__main__":
    main()
