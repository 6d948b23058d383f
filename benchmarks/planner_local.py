"""The planner against this machine: data-parallel training of small GPT-shaped models on 2 CPU
ranks, predicted (hardware cpu-here) vs measured step time and peak memory per rank.

    python -m benchmarks.planner_local               # two shapes, 4 steps each (~1 min idle)
    python -m benchmarks.planner_local --quick       # one shape, 3 steps

Each shape is planner.model.Model built in torch (token + position embeddings, pre-norm
nn.TransformerEncoderLayer × L, a tied output layer: the planner's parameter count exactly), fp32,
AdamW, one flat gradient all-reduce after backward through ringzero's default path (what
benchmarks.one_host fitted the cost model on; so the planner's dp term is not overlapped).
Time: median step after the first. Memory: VmHWM minus the RSS just before the model is built.
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
        h = self.emb(x) + self.pos.weight[: x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.emb.weight.t()


def _rank(rank, world, m: Model, mb: int, steps: int):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _vm("VmRSS")
    torch.manual_seed(0)
    net = Net(m)
    assert sum(p.numel() for p in net.parameters()) == m.params(), "torch model ≠ planner's count"
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(rank))
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


def measure(quick: bool, steps: int, mb: int = 4) -> list[dict]:
    hw = H.load("cpu-here")
    rows = []
    for m in SHAPES[:1] if quick else SHAPES:
        got = spawn(_rank, 2, args=(m, mb, steps), timeout=600)
        pred = predict_layout(m, m.seq, Layout(dp=2, tp=1, pp=1, mb=mb), 2 * mb, hw,
                              Software(overlap_dp=False, overlap_tp=False, overlap_pp=False, flash_attention=False))
        mem_pred = pred.memory["total"] - pred.memory["reserved"]
        rows.append({"model": m.name, "params": m.params(), "layout": "dp2 Z0 mb%d" % mb,
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
    console.print(f"load average while measuring: {open('/proc/loadavg').read().split()[0]} (shared cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
