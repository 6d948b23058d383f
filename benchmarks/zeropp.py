"""ZeRO++ qwZ and qgZ against plain ZeRO-3: the bytes each rank sent per optimizer step (the
ledger, per collective, next to its formula) and the training loss, on the same data.

    python benchmarks/zeropp.py                                  # an MLP (Ψ = 76,810), 2 ranks, 30 steps: ~15 s
    python benchmarks/zeropp.py --model classification --json zeropp_cls.json   # DistilBERT (MiniLM), slow
    python benchmarks/zeropp.py --world 4 --local-size 2         # 2 "nodes" × 2: hierarchical qgZ, + hpZ
    python benchmarks/zeropp.py --dtype bf16 --world 4 --local-size 2   # the same in bf16

Runs, each in fresh spawned gloo ranks (primitives transport), identical seeds and batches:
ZeRO-3, qwZ, qgZ, qwZ + qgZ (and qwZ + qgZ + hpZ with --local-size). Every unit is gathered in
forward and again in backward (stage3_param_persistence_threshold 0, stage3_max_reuse_distance
0), so per micro-batch ZeRO-3 sends 3(N-1)/N·4P bytes in fp32 and qwZ + qgZ
(N-1)·(2·w8(s) + w4(s)), w8(s) = s + 4⌈s/4096⌉, w4(s) = ⌈s/2⌉ + 4⌈s/64⌉, s = P/N: ≈ 0.21×.
With --dtype bf16 ZeRO-3 moves 2 bytes per element in all three: int8 weights twice and int4
gradients are ≥ (2 + 0.5)/6 = 0.417× of that on one node, whatever the block sizes; the paper's 4×
is the cross-node volume with hpZ (--local-size: the "inter / ZeRO-3" column); a line under the
table prints that floor for the run's N and node size. The last line counts what
DeepSpeed 0.19.8's own ZeRO-3 and ZeRO++ send on the same model (deepspeed_bytes: from its code;
its quantizer kernels need CUDA): on one node it keeps bf16 gradients (qgZ only across nodes),
≥ (1 + 1 + 2)/6 = 0.667× its ZeRO-3.
The loss column is the mean over ranks of the last 5 steps (one step's loss is one micro-batch's);
"inter-node" counts the bytes ALL ranks sent across a node boundary in step 1 (all purposes, the
primitives ledger's link classes; 0 on one node): in a flat ring only the node-boundary ranks
send them.
Machine: 2 shared cores, so the seconds are indicative only; bytes and losses are exact.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
from rich.table import Table

import zero_from_scratch
from primitives.launch import spawn
from primitives.engine.ledger import LEDGER
from primitives.log import console

BASE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
RUNS = {"ZeRO-3": {}, "qwZ": {"zero_quantized_weights": True}, "qgZ": {"zero_quantized_gradients": True},
        "qwZ + qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True}}
HPZ = ("qwZ + qgZ + hpZ", {"zero_quantized_weights": True, "zero_quantized_gradients": True})
NOT_DATA = ("grad-norm all-reduce", "divergence check", "monitor loss all-reduce")


def _mlp_task(rank, world, micro):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    teacher = nn.Linear(32, 10)
    nn.init.normal_(teacher.weight, std=0.5, generator=torch.Generator().manual_seed(7))

    def batch(step):
        x = torch.randn(micro, 32, generator=torch.Generator().manual_seed(1000 * (step % 16) + rank))
        return (x,), teacher(x).argmax(1).detach()

    def loss_of(engine, inputs, y):
        return nn.functional.cross_entropy(engine(*inputs), y)
    return model, batch, loss_of, 3e-3


def _classification_task(rank, world, micro):
    from classification import data as D   # optional dependency (transformers): only this model needs it
    from classification.batches import collate, tokenize   # idem
    from classification.model import load_model           # idem
    torch.manual_seed(0)
    model, tok, _ = load_model(num_labels=2, dropout=0.0)  # no dropout: the runs differ by quantisation only
    train = D.load().train
    ids = tokenize(tok, train.texts, 64)

    def batch(step):
        idx = [(step * world + rank) * micro + i for i in range(micro)]
        b = collate(ids, train.labels, idx, tok.pad_token_id)
        return (), b

    def loss_of(engine, inputs, b):
        return engine(**b).loss
    return model, batch, loss_of, 2e-5


TASKS = {"mlp": _mlp_task, "classification": _classification_task}


def _run(rank, world, task, zpp, steps, micro, local_size, dtype="fp32"):
    if local_size:
        os.environ["RINGZERO_LOCAL_SIZE"] = str(local_size)
    model, batch, loss_of, lr = TASKS[task](rank, world, micro)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": lr}}, "zero_optimization": {**BASE, **zpp}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, rep, t0 = [], None, 0.0
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        if step == 0:
            LEDGER.reset()
        inputs, y = batch(step)
        if dtype == "bf16":    # the model's inputs in its dtype (the engine casts the weights, not the data)
            inputs = tuple(t.bfloat16() if t.is_floating_point() else t for t in inputs)
        loss = loss_of(engine, inputs, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 0:
            rep = engine.comm_report(print_table=False)
            inter = LEDGER.links["inter"].bytes_sent if "inter" in LEDGER.links else 0
    rows = {r["purpose"]: {"sent": r["sent"], "formula": r["ring_formula"]} for r in rep["rows"]
            if r["purpose"] not in NOT_DATA}
    return {"losses": losses, "rows": rows, "data_sent": rep["data_sent"], "psi": engine.layout.numel, "inter": inter,
            "s_per_step": (time.perf_counter() - t0) / max(1, steps - 1)}


def compare(task="mlp", steps=30, world=2, micro=8, local_size=0, runs=None, dtype="fp32") -> dict:
    """{run name: {"losses": mean over ranks per step, "rows", "data_sent", "psi", "s_per_step"}: rank 0's
    bytes; "inter": all ranks' inter-node bytes}."""
    runs = dict(runs or RUNS)
    if local_size:
        runs[HPZ[0]] = {**HPZ[1], "zero_hpz_partition_size": local_size}
    out = {}
    for name, zpp in runs.items():
        res = spawn(_run, world, args=(task, zpp, steps, micro, local_size, dtype), timeout=3600.0)
        r0 = res[0]
        r0["losses"] = [sum(r["losses"][i] for r in res) / world for i in range(steps)]
        r0["inter"] = sum(r["inter"] for r in res)
        out[name] = r0
    return out


def table(results: dict, title: str) -> Table:
    base = results["ZeRO-3"]
    t = Table(title=title)
    for c in ("run", "collective (purpose)", "measured", "formula", "data / ZeRO-3", "inter-node", "inter / ZeRO-3",
              "loss, last 5",
              "Δ loss", "s/step"):
        t.add_column(c, justify="right")
    ref = sum(base["losses"][-5:]) / 5
    for name, r in results.items():
        loss = sum(r["losses"][-5:]) / 5
        first = True
        for purpose, row in r["rows"].items():
            t.add_row(name if first else "", purpose, f"{row['sent']:,}", f"{row['formula']:,}", "", "", "", "", "", "")
            first = False
        t.add_row("", "data total", f"{r['data_sent']:,}", "", f"{r['data_sent'] / base['data_sent']:.3f}",
                  f"{r['inter']:,}", f"{r['inter'] / base['inter']:.3f}" if base["inter"] else "", f"{loss:.4f}",
                  f"{100 * (loss - ref) / ref:+.2f} %", f"{r['s_per_step']:.2f}", end_section=True)
    return t


def floor(n: int, local: int, b: int) -> float:
    """ZeRO++'s data bytes ÷ ZeRO-3's at its bit widths with the scales free, per element of the model:
    int8 forward fetch over all n ranks, int8 backward fetch (over the node's `local` ranks with hpZ,
    else all n), int4 gradients (intra-node all-to-all, then 1/local of them across nodes); ZeRO-3
    moves b bytes per element three times over the n ranks."""
    L = local or n
    m = n // L
    zpp = (n - 1) / n + (L - 1) / L + 0.5 * ((L - 1) / L + (m - 1) / m / L)
    return zpp / (3 * b * (n - 1) / n)


def _ds_groups(n: int, target: int = 8000) -> int:
    """DeepSpeed 0.19.8's CUDAQuantizer.quantize group count for n int8 elements (partition_parameters.py)."""
    g = math.ceil(n / target)
    while g < n and n % (8 * g):
        g += 1
    while n % (16 * g) == 0 and n / g > target:
        g *= 2
    return g


def deepspeed_bytes(model: nn.Module, n: int, local: int, bf16: bool) -> dict:
    """Bytes one rank sends per micro-batch under DeepSpeed 0.19.8's own ZeRO-3 and ZeRO++, counted
    from its code (its quantizer kernels need CUDA, so not run here), every module fetched in
    forward and backward as in BASE: ZeRO-3 all-gathers each module's shards (b bytes each) twice
    and reduce-scatters its gradients (communication_data_type = the model dtype); qwZ quantizes
    both fetches to int8 with one fp32 scale per group (backward from hpZ's secondary partition,
    in the node, quantized the same way: partition_parameters._all_gather_coalesced); qgZ
    (coalesced_collectives.all_to_all_quant_reduce) sends a 2-D gradient as int4 with max(rows,
    cols, N) fp32 scales in an all-to-all inside the node, then 1/L of it across nodes; a 1-D
    gradient (a bias, a norm), and every gradient on one node (stage3.py: num_nodes > 1), goes
    through the reduce-scatter in the model dtype."""
    b, L = (2 if bf16 else 4), local or n
    nodes = n // L
    z3 = zpp = 0.0
    for m in model.modules():
        ps = list(m.parameters(recurse=False))
        if not ps:
            continue
        s = sum(math.ceil(p.numel() / n) for p in ps)               # this rank's shard of the module
        sec = sum(math.ceil(p.numel() / L) for p in ps)             # hpZ's secondary shard
        z3 += 2 * (n - 1) * b * s
        zpp += (n - 1) * (s + 4 * _ds_groups(s)) + (L - 1) * (sec + 4 * _ds_groups(sec))
        for p in ps:
            z3 += (n - 1) / n * b * p.numel()
            if nodes == 1 or p.dim() == 1 or p.numel() % (2 * n):
                zpp += (n - 1) / n * b * p.numel()
                continue
            groups = max(p.shape[0], p.shape[1], n)
            zpp += (L - 1) / L * (p.numel() / 2 + 4 * groups)
            if nodes > 1:
                zpp += (nodes - 1) / nodes * (p.numel() / (2 * L) + 4 * groups / L)
    return {"ZeRO-3": z3, "qwZ + qgZ" + (" + hpZ" if local else ""): zpp}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(TASKS), default="mlp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8, help="micro-batch per rank")
    ap.add_argument("--local-size", type=int, default=0, help="pretend nodes of this many ranks (+ an hpZ run)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: weights and gradients move as bf16")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--json", default=None, help="also write the results here (figures/ch14_zeropp.py reads it)")
    a = ap.parse_args(argv)
    runs = {k: v for k, v in RUNS.items() if k == "ZeRO-3" or not a.only or k in a.only.split(",")}
    res = compare(a.model, a.steps, a.world, a.micro, a.local_size, runs, a.dtype)
    psi = next(iter(res.values()))["psi"]
    console.print(table(res, f"ZeRO++ bytes sent per optimizer step by rank 0 and loss after {a.steps} steps "
                             f"({a.model}, Ψ={psi:,}, N={a.world}, {a.dtype})"))
    b = 2 if a.dtype == "bf16" else 4
    console.print(f"Floor at ZeRO++'s bit widths (int8 weights in both fetches, int4 gradients, scales free), data ÷ "
                  f"ZeRO-3: qwZ + qgZ {floor(a.world, 0, b):.3f}×"
                  + (f", + hpZ {floor(a.world, a.local_size, b):.3f}×" if a.local_size else ""), soft_wrap=True)
    ds = deepspeed_bytes(TASKS[a.model](0, a.world, a.micro)[0], a.world, a.local_size, a.dtype == "bf16")
    ours = {k: res[k]["data_sent"] for k in ds if k in res}
    console.print(f"DeepSpeed 0.19.8's own scheme on this model (counted from its code, not run: its quantizer needs "
                  f"CUDA), bytes rank 0 sends per step: ZeRO-3 {ds['ZeRO-3']:,.0f}; "
                  + "; ".join(f"{k} {v:,.0f} = {v / ds['ZeRO-3']:.3f}× its ZeRO-3"
                              + (f" (this engine: {ours[k] / ours['ZeRO-3']:.3f}×)" if k in ours else "")
                              for k, v in ds.items() if k != "ZeRO-3"), soft_wrap=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "world": a.world, "steps": a.steps, "dtype": a.dtype, "results": res}, f, indent=1)
    return res


if __name__ == "__main__":
    main()
