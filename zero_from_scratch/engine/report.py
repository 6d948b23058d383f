"""Memory and communication of ZeRO stages 0-3 side by side, for a model and N (no training).

    python -m zero_from_scratch.engine.report --model distilbert --world-size 2
    python -m zero_from_scratch.engine.report --model distilbert --world-size 4 --bf16

The model is built on the meta device (shapes only, no memory), the engine's own layout
function pads it exactly as a run would, and ledger.py turns the layout into bytes: what the
engine allocates per rank (the formula at the padded count P), the ZeRO paper's formula at Ψ,
DeepSpeed's estimator, and the ring bytes each rank sends per optimizer step.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from rich.table import Table

from primitives.log import console
from zero_from_scratch.engine.params import module_units
from zero_from_scratch.engine.ledger import (comm_bytes_per_step, deepspeed_estimate, model_state_bytes, paper_comm)
from zero_from_scratch.sharding import bucket_units, shard_layout

MODELS = ("distilbert", "distilbert-tiny", "mlp")


def build(name: str) -> nn.Module:
    with torch.device("meta"):
        if name.startswith("distilbert"):
            from transformers import DistilBertConfig, DistilBertForSequenceClassification  # optional dependency
            cfg = DistilBertConfig() if name == "distilbert" else DistilBertConfig(
                dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=100, max_position_embeddings=64)
            return DistilBertForSequenceClassification(cfg)
        return nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def layouts(model: nn.Module, n: int, bucket: int = 500_000_000) -> dict:
    """The layout each stage would use (one param group)."""
    names = [[k for k, p in model.named_parameters() if p.requires_grad]]
    shapes = [[(k, tuple(dict(model.named_parameters())[k].shape)) for k in names[0]]]
    out = {s: shard_layout(bucket_units(shapes, bucket), 1 if s == 0 else n) for s in (0, 1, 2)}
    out[3] = shard_layout(module_units(model, names), n)
    return out


def tables(model_name: str, n: int, mixed: bool) -> tuple[Table, Table, dict]:
    lays = layouts(build(model_name), n)
    psi = lays[1].numel
    b = 2 if mixed else 4
    mib = lambda x: f"{float(x) / 2**20:,.1f}" if x is not None else "—"  # noqa: E731
    prec = "bf16/fp16 + fp32 master" if mixed else "fp32"
    mem = Table(title=f"{model_name}: model-state MiB per rank, Ψ={psi:,}, N={n}, {prec}")
    mem.add_column("")
    for s in range(4):
        mem.add_column(f"ZeRO-{s}", justify="right")
    data = {}
    for s in range(4):
        lay = lays[s]
        data[s] = {"engine": model_state_bytes(s, lay.padded, n, mixed), "paper": model_state_bytes(s, psi, n, mixed),
                   "padding": lay.padding, "units": len(lay.units),
                   "deepspeed": deepspeed_estimate(s, psi, n, max(u.numel for u in lay.units)),
                   "comm": comm_bytes_per_step(s, [u.padded for u in lay.units], n, b),
                   "paper_comm": paper_comm(s, psi, n, b)}
    for k in ("params", "grads", "master", "optimizer"):
        mem.add_row(k, *[mib(data[s]["engine"][k]) for s in range(4)])
    mem.add_row("[bold]engine total[/bold]", *[mib(sum(data[s]["engine"].values())) for s in range(4)])
    mem.add_row("paper formula (Ψ)", *[mib(sum(data[s]["paper"].values())) for s in range(4)])
    mem.add_row("padding elements", *[f"{data[s]['padding']:,}" for s in range(4)])
    mem.add_row("DeepSpeed estimator", *[mib(data[s]["deepspeed"]) for s in range(4)])
    com = Table(title=f"{model_name}: MiB sent per optimizer step per rank (ring), N={n}, {b}-byte grads/params")
    com.add_column("")
    for s in range(4):
        com.add_column(f"ZeRO-{s}", justify="right")
    purposes = sorted({k for s in range(4) for k in data[s]["comm"]})
    for p in purposes:
        com.add_row(p, *[mib(data[s]["comm"].get(p)) if p in data[s]["comm"] else "—" for s in range(4)])
    com.add_row("[bold]total[/bold]", *[mib(sum(data[s]["comm"].values())) for s in range(4)])
    com.add_row("paper 2 or 3·(N-1)/N·Ψ", *[mib(data[s]["paper_comm"]) for s in range(4)])
    com.add_row("collective calls / step", *[str(data[s]["units"] * (1 if s == 0 else 2 if s < 3 else 3)) for s in range(4)])
    return mem, com, data


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="distilbert", choices=MODELS)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="mixed precision (2-byte params/grads, fp32 master)")
    a = ap.parse_args(argv)
    if a.world_size < 1:
        ap.error(f"--world-size must be >= 1, got {a.world_size}")
    mem, com, _ = tables(a.model, a.world_size, a.bf16)
    console.print(mem)
    console.print(com)


if __name__ == "__main__":
    main()
