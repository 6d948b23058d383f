"""The planner against this machine: small GPT-shaped models on 2 CPU ranks, predicted (hardware
cpu-here) vs measured step time and peak memory per rank.

    python -m benchmarks.planner_local               # DDP × 2 shapes, ZeRO-1/2/3, pp = 2; 4 steps each (~3 min idle)
    python -m benchmarks.planner_local --quick       # one shape DDP, 3 steps
    python -m benchmarks.planner_local --only pp2 --json rows.json      # some rows; the rows as JSON

Each shape is planner.model.Model built in torch (token + position embeddings, pre-norm
nn.TransformerEncoderLayer × L, a tied output layer: the planner's parameter count exactly), fp32,
AdamW. Rows: DDP with one flat gradient all-reduce after backward through ringzero's default path
(what benchmarks.one_host fitted the cost model on; so the planner's dp term is not overlapped);
ZeRO-1/2/3 of the smaller shape through zero_from_scratch's engine (overlap_comm off); pp = 2
through pipeline_parallel's engine (1F1B, 4 micro-batches, L/2 layers per stage). Not run:
tp = 2 (tensor_parallel.parallelize takes Hugging Face DistilBERT and MLP stacks, not this
layer, and the planner has no activation formula for DistilBERT's eager layer yet) and offload
(the planner refuses it on cpu-here: the host is the device).
Time: median step after the first. The planner is given the compute, memory and Adam rates each
rank gets IN THIS RUN (_rates: the step's GEMM shapes, an add, torch's AdamW, timed by both ranks
at once before every step; "same-run" column), and, for comparison, the rates of
planner/cpu_here.json fitted earlier under whatever load there was then ("file" column): on
shared cores the load, not the model, decides a rank's share of a core. Links: the cost model's
α-β fitted by benchmarks.one_host.
Memory, exactly what is measured: the peak resident set (VmHWM, clear_refs reset) minus the RSS
just before the model is built, per rank, the larger rank reported. Before the baseline a tiny
model runs one step with AdamW and one all-reduce, so torch's lazily loaded modules and pools are
in the baseline, not in the measurement (that is the planner's `reserved`, left out of both
sides). glibc's mmap threshold is fixed at 64 KiB (mallopt) so a freed tensor leaves the resident
set: with the default, the threshold rises to the largest block freed (up to 32 MiB) and later
activations come from a heap that is not returned, so RSS would count freed memory that no
formula describes. The planner's activation family for cpu-here is torch's eager fp32 encoder
layer (planner.memory.torch_layer_activation_bytes).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from dataclasses import replace

import torch
from rich.table import Table

import primitives as P
import zero_from_scratch
from planner import hardware as H
from planner.layout import Layout
from planner.model import Model
from planner.plan import predict_layout
from planner.steptime import Software
from pipeline_parallel import LayerSpec, PipelineModule, TiedLayerSpec
from pipeline_parallel import initialize as pipe_initialize
from pipeline_parallel.engine.model import Embed, FinalNorm, head, lm_loss
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


def _rates(m: Model, mb: int, window: float = 0.15) -> tuple[float, float, float]:
    """(FLOP/s, bytes/s, Adam parameters/s) this rank gets now, each from work repeated for a
    window of wall time (long against the scheduler's slices, so a shared core's share is in the
    rate, not only its speed): the step's GEMM shapes in turn (T = b·s tokens: a linear's forward
    T×h·h×f, its input gradient T×f·f×h, its weight gradient h×T·T×f, the logits T×h·h×V) for
    `window`; a 4 MiB add and torch's AdamW on 2^20 parameters for a fifth of it each."""
    T, h, f, V = mb * m.seq, m.hidden, m.f, m.vocab
    mats = [(torch.randn(i, k), torch.randn(k, j)) for i, k, j in ((T, h, f), (T, f, h), (h, T, f), (T, h, V))]
    x = torch.zeros(2**20)
    y = torch.zeros_like(x)
    p = torch.nn.Parameter(torch.zeros(2**20))
    p.grad = torch.ones_like(p)
    adam = torch.optim.AdamW([p], lr=1e-4)
    ops = ((sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in mats), lambda: [a @ b for a, b in mats], window),
           (2 * x.numel() * 4, lambda: torch.add(x, 1.0, out=y), window / 5),
           (p.numel(), adam.step, window / 5))
    out = []
    for work, op, w in ops:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < w:
            op()
            n += 1
        out.append(n * work / (time.perf_counter() - t0))
    return out[0], out[1], out[2]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")          # VmHWM := VmRSS


def _warm() -> int:
    """Load what a first step loads, then return the baseline RSS (module docstring)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)     # M_MMAP_THRESHOLD: fixed, see the docstring
    warm = Net(Model("warm", 1, 64, 4, 64, 16, positions=16))     # torch's modules and pools load here, not below
    wopt = torch.optim.AdamW(warm.parameters())
    warm(torch.zeros(1, 16, dtype=torch.long)).sum().backward()
    wopt.step()
    P.all_reduce(torch.zeros(16))
    del warm, wopt
    _reset_peak()
    return _vm("VmRSS")


def _timed(one_step, m: Model, mb: int, steps: int, base: int) -> dict:
    """Run `steps` steps; before each, sample the rates (so they see the load the step sees), then
    reset the peak so the samples' buffers are not in it. Step: the median after the first."""
    times, peaks, rates = [], [], []
    for _ in range(steps):
        rates.append(_rates(m, mb))
        _reset_peak()
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
        peaks.append(_vm("VmHWM") - base)
    return {"step": statistics.median(times[1:]), "peak": max(peaks), "flops": statistics.median(r[0] for r in rates),
            "bw": statistics.median(r[1] for r in rates), "adam": statistics.median(r[2] for r in rates)}


def _rank(rank, world, m: Model, mb: int, steps: int, zero: int | None = None):
    base = _warm()
    torch.manual_seed(0)
    net = Net(m)
    assert sum(p.numel() for p in net.parameters()) == m.params(), "torch model ≠ planner's count"
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(rank))
    if zero is not None:
        return _zero_steps(net, x, zero, m, mb, steps, base)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step():
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in net.parameters()])
        P.all_reduce(flat)
        off = 0
        for p in net.parameters():
            p.grad.copy_(flat[off:off + p.numel()].view_as(p)).div_(world)
            off += p.numel()
        del flat              # the copy lives only while it is reduced (planner.memory: ZeRO-0's working)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return _timed(step, m, mb, steps, base)


def _zero_steps(net, x, zero: int, m: Model, mb: int, steps: int, base: int):
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

    def step():
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
    return _timed(step, m, mb, steps, base)


def _pp_rank(rank, world, m: Model, mb: int, micro: int, steps: int):
    """pp = 2 through pipeline_parallel's DeepSpeed-API engine (1F1B, `micro` micro-batches of mb):
    the same layers as Net (token + position embedding tied to the head, torch's encoder layer)."""
    base = _warm()
    layers = ([TiedLayerSpec("embed", Embed, m.vocab, m.hidden, m.positions)]
              + [LayerSpec(torch.nn.TransformerEncoderLayer, m.hidden, m.heads, m.f, dropout=0.0, batch_first=True,
                           norm_first=True) for _ in range(m.layers)]
              + [LayerSpec(FinalNorm, m.hidden), TiedLayerSpec("embed", Embed, m.vocab, m.hidden, m.positions, forward_fn=head)])
    half = m.layers // 2      # the planner's split: L/p layers per stage, the embedding first, norm and head last
    pm = PipelineModule(layers, num_stages=2, loss_fn=lm_loss, partition_method=[1 + half, m.layers - half + 2])
    engine, *_ = pipe_initialize(model=pm, config={
        "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "pipeline": {"schedule": "1f1b"}}, dp=1)
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(0))
    return _timed(lambda: engine.train_batch(data_iter=iter([(x, x)] * micro)), m, mb, steps, base)


def runs(quick: bool, steps: int, mb: int = 4):
    """(model, layout label, Layout, global batch, rank function, its args) of every row."""
    small, mid = SHAPES
    out = [(small, f"dp2 Z0 (torch) mb{mb}", Layout(2, 1, 1, mb=mb), 2 * mb, _rank, (small, mb, steps, None))]
    if quick:
        return out
    out.append((mid, f"dp2 Z0 (torch) mb{mb}", Layout(2, 1, 1, mb=mb), 2 * mb, _rank, (mid, mb, steps, None)))
    out += [(small, f"dp2 Z{z} (engine) mb{mb}", Layout(2, 1, 1, zero=z, mb=mb), 2 * mb, _rank, (small, mb, steps, z))
            for z in (1, 2, 3)]
    out.append((small, "pp2 1F1B m4 mb2 (engine)", Layout(1, 1, 2, mb=2), 8, _pp_rank, (small, 2, 4, steps)))
    return out


def measure(quick: bool, steps: int, only: str = "") -> list[dict]:
    hw = H.load("cpu-here")
    sw = Software(overlap_dp=False, overlap_tp=False, overlap_pp=False, flash_attention=False)
    rows = []
    for m, label, lay, batch, fn, args in runs(quick, steps):
        if only not in label:
            continue
        got = spawn(fn, lay.gpus, args=args, timeout=600)
        flops, bw = min(g["flops"] for g in got), min(g["bw"] for g in got)     # the slower rank sets the pace
        here = replace(hw, peak_flops=flops, gemm_efficiency=1.0, mem_bandwidth=bw, host_link=bw,
                       host_adam=min(g["adam"] for g in got))
        pred = predict_layout(m, m.seq, lay, batch, here, sw)
        from_file = predict_layout(m, m.seq, lay, batch, hw, sw)
        rows.append({"model": m.name, "params": m.params(), "layout": label,
                     "step_pred": pred.time["total"], "step_file": from_file.time["total"],
                     "step_meas": max(g["step"] for g in got), "gflops": flops / 1e9, "gbs": bw / 1e9,
                     "time_terms": pred.time,
                     "mem_pred": pred.memory["total"] - pred.memory["reserved"], "mem_terms": pred.memory,
                     "mem_meas": max(g["peak"] for g in got), "mem_per_rank": [g["peak"] for g in got],
                     "load": float(open("/proc/loadavg").read().split()[0])})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", help="write the rows (predicted terms, measured) to this file")
    ap.add_argument("--only", default="", help="rows whose layout label contains this text (e.g. pp2, Z3)")
    a = ap.parse_args(argv)
    rows = measure(a.quick, max(2, a.steps if not a.quick else 3), a.only)
    loads = [r["load"] for r in rows]
    t = Table(title=f"planner vs this machine (2 CPU ranks, fp32), measured under load {min(loads):.1f}-{max(loads):.1f} on 2 cores")
    for c in ("model", "params", "layout", "GFLOP/s", "step ms same-run", "file", "measured", "error",
              "MiB predicted", "measured ", "error "):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["model"], f"{r['params'] / 1e6:.1f} M", r["layout"], f"{r['gflops']:.1f}", f"{r['step_pred'] * 1e3:.0f}",
                  f"{r['step_file'] * 1e3:.0f}", f"{r['step_meas'] * 1e3:.0f}", f"{r['step_pred'] / r['step_meas'] - 1:+.0%}",
                  f"{r['mem_pred'] / 2**20:.0f}", f"{r['mem_meas'] / 2**20:.0f}", f"{r['mem_pred'] / r['mem_meas'] - 1:+.0%}")
    console.print(t)
    errs = [abs(r["step_pred"] / r["step_meas"] - 1) for r in rows], [abs(r["mem_pred"] / r["mem_meas"] - 1) for r in rows]
    ferr = [abs(r["step_file"] / r["step_meas"] - 1) for r in rows]
    console.print(f"median |error|: step time {statistics.median(errs[0]):.0%} (same-run rates; "
                  f"{statistics.median(ferr):.0%} with cpu_here.json's), memory {statistics.median(errs[1]):.0%}; "
                  f"misses (time > 25 %, memory > 10 %): "
                  + (", ".join(f"{r['model']} {r['layout']}" for r, et, em in zip(rows, *errs) if et > 0.25 or em > 0.10) or "none"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
