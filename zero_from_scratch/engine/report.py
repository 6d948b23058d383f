"""Memory and communication of ZeRO stages 0-3 side by side, for a model and N (no training).

    python -m zero_from_scratch.engine.report --model distilbert --world-size 2
    python -m zero_from_scratch.engine.report --model distilbert --world-size 4 --bf16

The model is built on the meta device (shapes only, no memory), the engine's own layout
function pads it exactly as a run would, and ledger.py turns the layout into bytes: what the
engine allocates per rank (the formula at the padded count P), the ZeRO paper's formula at Ψ,
DeepSpeed's estimator, and the ring bytes each rank sends per optimizer step.
working_set(engine) adds what a ZeRO-3 run holds besides the model states, each bounded by a
config key (the engine's pools, engine/pools.py, never hold more): the gradient shards of
offload_optimizer "nvme" (one per shard size; the norm and the step read them into the same
buffers), the transport's reduce-scatter block (comm.RS_PIECE_BYTES at most) and shared-memory
pages, the process's own overhead (measured, named); in forward and backward the gathered units
(≤ stage3_max_live_parameters, at least the largest unit; the prefetch counts in it), the gradient
buckets (one, two with overlap_comm), the autograd gradient of one unit before its bucket takes
it and the activations of a batch (given); in the step the shard offload_param's writer holds
(one per shard size: the step streams unit by unit) and the optimizer's staging. The peak is the
held parts plus the larger phase. The engine prints its line at start-up (stage3.py);
benchmarks/infinity_memory.py and benchmarks/zero_memory_table.py set it beside the measured peak.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
import torch.nn as nn
from rich.table import Table

from primitives.engine.shm_collectives import BUFS
from primitives.engine.shm_segment import SLOT_BYTES, SLOTS, WS_BYTES
from primitives.log import console, print0
from zero_from_scratch.engine import comm, offload, param_offload, step
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.precision import model_dtype
from zero_from_scratch.engine.params import module_units
from zero_from_scratch.engine.ledger import (comm_bytes_per_step, deepspeed_estimate, model_state_bytes, paper_comm)
from zero_from_scratch.sharding import bucket_units, shard_layout

MODELS = ("distilbert", "distilbert-tiny", "mlp")
MIB = 2 ** 20


def live_bound(sizes: list[int], max_live: int) -> int:
    """Elements gathered at once under stage3_max_live_parameters: the most consecutive units (in
    layout order, which the trace follows) that fit under it, at least the largest unit."""
    best, lo, run = max(sizes, default=0), 0, 0
    for hi, n in enumerate(sizes):
        run += n
        while run > max_live and lo <= hi:
            run, lo = run - sizes[lo], lo + 1
        best = max(best, run)
    return best


# resident bytes of a training process that no buffer below accounts for: code pages of the
# kernels first run, small heap blocks, and per unit the interpreter's objects (the unit, its
# hooks and trace entries, autograd's per-module hook state: Python arenas, seen in smaps).
# Measured on this machine as a ZeRO-3 rank's peak minus every part named here, on the residual
# MLP with 48 and 256 units (benchmarks/infinity_memory.py): 13 and 24 MiB
PROCESS_OVERHEAD = 11 * MIB
UNIT_OVERHEAD = 52 << 10
# pages of the shared-memory segment a rank touches: its BUFS workspaces and the point-to-point
# slots the ring algorithms use (primitives/engine/shm_segment.py), measured 8 MiB per rank at N = 2
SHM_SLOT_PAGES = SLOTS * SLOT_BYTES // 2
BACKWARD_ONLY = ("gathered units (max_live)", "gradient buckets", "autograd gradient of a unit", "activations")
STEP_ONLY = ("offload_param buffers (step)", "optimizer staging + temporaries (step)")


def working_set(cfg, layout, n: int, activations: int = 0) -> dict:
    """Bytes per rank a ZeRO-3 run of `cfg` (engine.config) on `layout` holds in host memory (a
    CPU model) while training: the model states left in memory and the working set, by part.
    "total" is the peak: the parts held throughout, plus the larger of the forward and backward's
    (gathered units, buckets, autograd's gradient, activations) and the step's (writer buffers,
    optimizer staging), which the engine frees between phases (its allocator setting on: allocator.py)."""
    z, units = cfg.zero, layout.units
    b = torch.empty(0, dtype=model_dtype(cfg)).element_size()
    mixed = b != 4
    shards = sum(u.shard for u in units)
    big_unit = max(u.padded for u in units)
    poff, ooff = getattr(cfg, "offload_param", None), cfg.offload_optimizer
    nvme_opt = bool(ooff) and ooff["device"] == "nvme"
    keys = 3 if mixed else 2                        # (fp32 master,) Adam m, v
    in_cpu = shards if not poff or poff["device"] != "nvme" else min(shards, poff["max_in_cpu"])
    sizes = [u.shard for u in units]
    out = {"parameter shards": b * in_cpu,
           "gradient shards": 0 if nvme_opt else b * shards,          # nvme at stage 3: in files too
           "optimizer states": 0 if nvme_opt else 4 * keys * shards,
           "gathered units (max_live)": b * live_bound([u.padded for u in units], z.stage3_max_live_parameters),
           # backward: one idle buffer per shard size (each reduce is written out at once)
           "gradient shard buffers": b * sum(set(sizes)) if nvme_opt else 0,
           # the ring reduce-scatter's receive blocks (primitives/comm.py scratch, kept by the communicator,
           # one per step up to two): each a shard of the largest unit, or comm.py's piece if smaller
           "reduce-scatter scratch": min(2, n - 1) * min(b * max(sizes), comm.RS_PIECE_BYTES) if n > 1 else 0,
           # the shared-memory transport (primitives/engine/shm_segment.py), ranks on one host
           "shm transport pages": BUFS * WS_BYTES + SHM_SLOT_PAGES if n > 1 else 0,
           "process overhead": PROCESS_OVERHEAD + UNIT_OVERHEAD * len(units),
           "gradient buckets": b * big_unit * (2 if z.overlap_comm and n > 1 and not nvme_opt else 1),
           "autograd gradient of a unit": b * big_unit,
           "activations": activations,
           # the step streams unit by unit (stage3.done_with): one shard buffer per shard size; the
           # gradient shards reuse the backward's idle buffers above
           "offload_param buffers (step)": b * sum(set(sizes)) if poff else 0}
    if nvme_opt:
        chunk = offload.stream_chunk(SimpleNamespace(layout=layout), cfg.sub_group_size)
        out["optimizer staging + temporaries (step)"] = 4 * chunk * (keys + 2)
    else:
        out["optimizer staging + temporaries (step)"] = 4 * 2 * min(step.STEP_CHUNK, max(sizes))
    held = sum(v for k, v in out.items() if k not in BACKWARD_ONLY + STEP_ONLY)
    out["total"] = held + max(sum(out[k] for k in BACKWARD_ONLY), sum(out[k] for k in STEP_ONLY))
    return out


def built_bytes(make) -> int:
    """Bytes a model's constructor allocates in all: every parameter and buffer it registers, those
    it drops or replaces later included (a T5 builds two embeddings and an lm_head before tying
    them to `shared`), counted by building it on the meta device: a model built whole peaks at this."""
    seen: dict[int, torch.Tensor] = {}                 # holding each tensor: no id is reused

    def hook(module, name, t):
        if t is not None:
            seen[id(t)] = t
    mod = torch.nn.modules.module
    hooks = [mod.register_module_parameter_registration_hook(hook), mod.register_module_buffer_registration_hook(hook)]
    try:
        with torch.device("meta"):
            make()
    finally:
        for h in hooks:
            h.remove()
    return sum(t.numel() * t.element_size() for t in seen.values())


def whole_model_peak(ws: dict, built: int, model_bytes: int) -> int:
    """The peak of a ZeRO-3 run whose model is built whole (not under zero.Init): the constructor's
    (built_bytes), initialize's (the whole model still held while its shards and the states left in
    memory are made, with the held overheads) or training's (ws["total"]), whichever is larger."""
    states = ws["parameter shards"] + ws["gradient shards"] + ws["optimizer states"]
    return max(ws["total"], built, model_bytes + states + ws["shm transport pages"] + ws["process overhead"])


def stage1_peak(cfg, layout, n: int, built: int) -> int:
    """Peak bytes per rank of a ZeRO-1 run whose model is built whole: the constructor's tensors
    (built_bytes: copied into the flat buffer and freed, they stay resident as heap, the engine
    setting its allocator at stage 3 only, allocator.py; the activations, autograd's gradients
    and the step's temporaries then reuse those holes), the flat parameters and gradients (b·P
    each), the optimizer states (K·P/N), the transport's pages and the process overhead (measured
    within 5 % on the T5 table, benchmarks/zero_memory_table.py)."""
    b = torch.empty(0, dtype=model_dtype(cfg)).element_size()
    p, keys = sum(layout.group_flat), 3 if b != 4 else 2
    return (built + 2 * b * p + 4 * keys * p // n + (BUFS * WS_BYTES + SHM_SLOT_PAGES if n > 1 else 0)
            + PROCESS_OVERHEAD + UNIT_OVERHEAD * len(layout.units))


def mlp_activations(batch: int, dim: int, layers: int) -> int:
    """fp32 bytes autograd keeps for a residual MLP block x + tanh(Linear(x)): its input, the
    linear's output and tanh's output, per block."""
    return 4 * 3 * batch * dim * layers


def key_allowance(cfg, layout) -> str:
    """One line: what each stage-3 key allows in host memory on this engine (a CPU model)."""
    z = cfg.zero
    b = torch.empty(0, dtype=model_dtype(cfg)).element_size()
    sizes = [u.padded for u in layout.units]
    reuse = "no unit kept past its forward" if z.stage3_max_reuse_distance == 0 else "units kept for reuse"
    persist = b * sum(n for n in sizes if n <= z.stage3_param_persistence_threshold)
    return (f"\\[zero_from_scratch] host memory per rank the ZeRO-3 keys allow ({b}-byte elements): "
            f"stage3_max_live_parameters {z.stage3_max_live_parameters:,.0f} → ≤ "
            f"{b * live_bound(sizes, z.stage3_max_live_parameters) / MIB:,.1f} MiB gathered at once, which "
            f"stage3_prefetch_bucket_size {z.stage3_prefetch_bucket_size:,.0f} (≤ "
            f"{b * min(z.stage3_prefetch_bucket_size, sum(sizes)) / MIB:,.1f} MiB ahead) and "
            f"stage3_max_reuse_distance {z.stage3_max_reuse_distance:,.0f} ({reuse}) stay within; "
            f"stage3_param_persistence_threshold {z.stage3_param_persistence_threshold:,.0f} → "
            f"{persist / MIB:,.1f} MiB kept gathered")


# DeepSpeed's defaults of the keys that bound the working set: a config that sets one, or
# offload_param, gets a start-up line saying how much host memory each allows
MEMORY_KEYS = {"stage3_max_live_parameters": 1_000_000_000, "stage3_prefetch_bucket_size": 50_000_000,
               "stage3_max_reuse_distance": 1_000_000_000, "stage3_param_persistence_threshold": 100_000}


def announce(cfg, layout) -> None:
    """The engine's start-up line (rank 0), when the config sizes ZeRO-3's memory."""
    if getattr(cfg, "offload_param", None) is not None or any(getattr(cfg.zero, k) != d for k, d in MEMORY_KEYS.items()):
        print0(key_allowance(cfg, layout), soft_wrap=True)


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


def transformer_activations(config, batch: int, seq: int, b: int, recompute: bool = False) -> int:
    """Activation bytes of a transformer for a batch (Korthikanti et al. 2022, no recomputation:
    (34·s·h + 5·a·s²)·B per layer at 2-byte activations, scaled to b bytes), plus the logits and
    their gradient (2·B·s·V·b). recompute (activation checkpointing, "full recomputation"): each
    layer keeps only its input, s·B·h·b, and one layer's activations live again in its backward.
    config: a transformers config (DistilBERT's or T5's names)."""
    c = config
    h = getattr(c, "dim", None) or getattr(c, "d_model", 0)
    a = getattr(c, "n_heads", None) or getattr(c, "num_heads", 1)
    layers = (getattr(c, "n_layers", None) or getattr(c, "num_layers", 1)) + (getattr(c, "num_decoder_layers", 0) or 0)
    per_layer = batch * (34 * seq * h + 5 * a * seq * seq) * b / 2
    kept = layers * seq * batch * h * b + per_layer if recompute else layers * per_layer
    return int(kept + 2 * batch * seq * getattr(c, "vocab_size", 0) * b)


def working_set_table(model_name: str, n: int, mixed: bool, batch: int, seq: int, config: str | None) -> tuple:
    """The ZeRO-3 working set of `config` (a DeepSpeed JSON; default: stage 3, DeepSpeed's defaults)."""
    model = build(model_name)
    raw = config or {"train_batch_size": batch * n, "bf16": {"enabled": mixed}, "zero_optimization": {"stage": 3}}
    cfg = load_config(raw, n)
    lay = layouts(model, n)[3]
    b = torch.empty(0, dtype=model_dtype(cfg)).element_size()
    act = transformer_activations(model.config, batch, seq, b) if model_name.startswith("distilbert") else 0
    ws = working_set(cfg, lay, n, act)
    t = Table(title=f"{model_name}: ZeRO-3 host memory per rank (MiB), N={n}, {config or 'DeepSpeed defaults'}, "
                    f"micro-batch {batch} × {seq}")
    t.add_column("part")
    t.add_column("MiB", justify="right")
    for k, v in ws.items():
        t.add_row(f"[bold]{k}[/bold]" if k == "total" else k, f"{v / MIB:,.1f}")
    return t, key_allowance(cfg, lay)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="distilbert", choices=MODELS)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="mixed precision (2-byte params/grads, fp32 master)")
    ap.add_argument("--config", default=None, help="a DeepSpeed JSON for the ZeRO-3 working set (stage3_* keys, offload)")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch for the activations (transformers)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length for the activations (transformers)")
    a = ap.parse_args(argv)
    if a.world_size < 1:
        ap.error(f"--world-size must be >= 1, got {a.world_size}")
    mem, com, _ = tables(a.model, a.world_size, a.bf16)
    console.print(mem)
    console.print(com)
    ws, line = working_set_table(a.model, a.world_size, a.bf16, a.batch, a.seq, a.config)
    console.print(ws)
    console.print(line, soft_wrap=True)


if __name__ == "__main__":
    main()
