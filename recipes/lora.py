"""Model-state memory per ZeRO stage, full fine-tuning vs LoRA adapters (shapes only, no processes).

    python -m recipes.lora --model distilbert --r 8 --world-size 2
    deepspeed --num_gpus 2 classification/train.py --lora 8      (training with the adapters)

The adapters themselves (peft, the frozen base under ZeRO) are zero_from_scratch/engine/lora.py.
Per rank: the paper's model-state formula with trainable Ψ_lora, plus the frozen weights b·Ψ_frozen
(b·Ψ_frozen/N at ZeRO-3, which partitions them too).
"""
from __future__ import annotations

import argparse

import torch
from rich.table import Table

from primitives.log import console
from zero_from_scratch.engine.ledger import model_state_bytes
from zero_from_scratch.engine.lora import apply_lora, trainable_counts
from zero_from_scratch.engine.report import build


def memory_table(model_name: str = "distilbert", r: int = 8, n: int = 2, mixed: bool = False):
    """(rich table, rows): model-state bytes per rank by stage, full fine-tuning vs LoRA r."""
    full = build(model_name)
    psi = sum(p.numel() for p in full.parameters())
    with torch.device("meta"):
        tp, fp = trainable_counts(apply_lora(build(model_name), r))
    b = 2 if mixed else 4
    mib = lambda x: f"{float(x) / 2**20:,.1f}"  # noqa: E731
    t = Table(title=f"{model_name}: model-state MiB per rank, N={n}, {'mixed' if mixed else 'fp32'}; "
                    f"full Ψ={psi:,}, LoRA r={r}: trainable {tp:,}, frozen {fp:,}")
    t.add_column("")
    for s in range(4):
        t.add_column(f"ZeRO-{s}", justify="right")
    rows = {"full fine-tuning": [sum(model_state_bytes(s, psi, n, mixed).values()) for s in range(4)],
            "LoRA: trainable states": [sum(model_state_bytes(s, tp, n, mixed).values()) for s in range(4)],
            "LoRA: frozen weights": [b * fp / (n if s == 3 else 1) for s in range(4)]}
    rows["LoRA total"] = [a + c for a, c in zip(rows["LoRA: trainable states"], rows["LoRA: frozen weights"])]
    for k, v in rows.items():
        t.add_row(k, *[mib(x) for x in v])
    t.add_row("saved by LoRA", *[f"{1 - lo / fu:.0%}" for lo, fu in zip(rows["LoRA total"], rows["full fine-tuning"])])
    return t, rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="model-state memory per ZeRO stage, full fine-tuning vs LoRA")
    ap.add_argument("--model", default="distilbert", choices=("distilbert", "distilbert-tiny"))
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    console.print(memory_table(a.model, a.r, a.world_size, a.bf16)[0])
