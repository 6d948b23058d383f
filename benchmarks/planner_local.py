"""The planner against this machine: data-parallel training of small GPT-shaped models on 2 CPU
ranks, predicted (hardware cpu-here) vs measured step time and peak memory per rank.

    python -m benchmarks.planner_local               # two shapes DDP + ZeRO-1/2/3, 4 steps each (~3 min idle)
    python -m benchmarks.planner_local --quick       # one shape DDP, 3 steps

Each shape is planner.model.Model built in torch (token + position embeddings, pre-norm
nn.TransformerEncoderLayer × L, a tied output layer: the planner's parameter count exactly), fp32,
AdamW, one flat gradient all-reduce after backward through ringzero's default path (what
benchmarks.one_host fitted the cost model on; so the planner's dp term is not overlapped); then
ZeRO-1/2/3 of the smaller shape through zero_from_scratch's engine (overlap_comm off).
Time: median step after the first. Memory: VmHWM minus the RSS just before the model is built
(after a warm-up step of a tiny model, so torch's lazily loaded kernels and pools are not counted).
The planner's activation bytes are Korthikanti's for Megatron's layer, not torch's encoder
layer: the memory column tests how far that transfers.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.table import Table

import primitives as P
import zero_from_scratch
from planner import hardware as H
from planner.layout import Layout
from planner.model import Model
from planner.plan import predict_layout
from planner.steptime import Software
from primitives.launch import spawn
from primitives.log import console

SHAPES = [Model("gpt-mini", 4, 256, 4, 8192, 128, positions=128), Model("gpt-small", 6, 384, 6, 16384, 128, positions=128)]


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))


class Net(torch.nn.Module):
    def __init__(self, m: Model):
        super().__init__()
        self.emb = torch.nn.Embedding(m.vocab, m.hidden)
        self.pos = torch.nn.Embedding(m.positions, m.hidden)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(
            m.hidden, m.heads, m.f, dropout=0.0, batch_first=True, norm_first=True) for _ in range(m.layers))
        self.norm = torch.nn.LayerNorm(m.hidden)

    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.emb.weight.t()


def _rank(rank, world, m: Model, mb: int, steps: int, zero: int | None = None):
    warm = Net(Model("warm", 1, 64, 4, 64, 16, positions=16))     # torch's kernels and pools load here, not below
    warm(torch.zeros(1, 16, dtype=torch.long)).sum().backward()
    del warm
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _vm("VmRSS")
    torch.manual_seed(0)
    net = Net(m)
    assert sum(p.numel() for p in net.parameters()) == m.params(), "torch model ≠ planner's count"
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(rank))
    if zero is not None:
        return _zero_steps(net, x, zero, mb, steps, base)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in net.parameters()])
        P.all_reduce(flat)
        off = 0
        for p in net.parameters():
            p.grad.copy_(flat[off:off + p.numel()].view_as(p)).div_(world)
            off += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    return {"step": statistics.median(times[1:]), "peak": _vm("VmHWM") - base}


def _zero_steps(net, x, zero: int, mb: int, steps: int, base: int):
    """The same steps through zero_from_scratch's DeepSpeed-API engine at ZeRO `zero` (fp32, AdamW)."""
    if zero == 3:     # the tied output layer reads the embedding's weight outside the embedding's forward
        zero_from_scratch.register_external_parameter(net, net.emb.weight)
        for layer in net.layers:   # nn.MultiheadAttention reads out_proj's tensors without calling it
            for p in layer.self_attn.out_proj.parameters():
                zero_from_scratch.register_external_parameter(layer.self_attn, p)
    engine, *_ = zero_from_scratch.initialize(model=net, model_parameters=net.parameters(), dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero, "overlap_comm": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    return {"step": statistics.median(times[1:]), "peak": _vm("VmHWM") - base}


def measure(quick: bool, steps: int, mb: int = 4) -> list[dict]:
    hw = H.load("cpu-here")
    rows = []
    runs = [(SHAPES[0], None)] if quick else [(m, None) for m in SHAPES] + [(SHAPES[0], z) for z in (1, 2, 3)]
    for m, zero in runs:
        got = spawn(_rank, 2, args=(m, mb, steps, zero), timeout=600)
        pred = predict_layout(m, m.seq, Layout(dp=2, tp=1, pp=1, mb=mb, zero=zero or 0), 2 * mb, hw,
                              Software(overlap_dp=False, overlap_tp=False, overlap_pp=False, flash_attention=False))
        mem_pred = pred.memory["total"] - pred.memory["reserved"]
        rows.append({"model": m.name, "params": m.params(),
                     "layout": (f"dp2 Z{zero} (engine)" if zero is not None else "dp2 Z0 (torch)") + f" mb{mb}",
                     "step_pred": pred.time["total"], "step_meas": max(g["step"] for g in got),
                     "mem_pred": mem_pred, "mem_meas": max(g["peak"] for g in got)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args(argv)
    rows = measure(a.quick, max(2, a.steps if not a.quick else 3))
    t = Table(title="planner vs this machine (2 CPU ranks, fp32)")
    for c in ("model", "params", "layout", "step ms predicted", "measured", "error", "MiB predicted", "measured ", "error "):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["model"], f"{r['params'] / 1e6:.1f} M", r["layout"], f"{r['step_pred'] * 1e3:.0f}", f"{r['step_meas'] * 1e3:.0f}",
                  f"{r['step_pred'] / r['step_meas'] - 1:+.0%}", f"{r['mem_pred'] / 2**20:.0f}", f"{r['mem_meas'] / 2**20:.0f}",
                  f"{r['mem_pred'] / r['mem_meas'] - 1:+.0%}")
    console.print(t)
    errs = [abs(r["step_pred"] / r["step_meas"] - 1) for r in rows], [abs(r["mem_pred"] / r["mem_meas"] - 1) for r in rows]
    console.print(f"median |error|: step time {statistics.median(errs[0]):.0%}, memory {statistics.median(errs[1]):.0%}; "
                  f"load average while measuring: {open('/proc/loadavg').read().split()[0]} (shared cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
