"""Published runs the planner is checked against, each number with where it came from, and the
comparison: the run's own layout predicted, and the planner's best layout for the same model.

    python -m benchmarks.planner_published           # both tables, errors, misses
    python -m pytest -q tests/test_planner_published.py

NARAYANAN: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21, arXiv 2104.04473, Table 1; rows read from the same table as Megatron-LM's
  README showed it on 2021-04-08 (commit 50a4b5fa02, images/cases_april2021.png: hidden, layers,
  parameters, model-parallel size, GPUs, batch, achieved TFLOP/s per GPU). That image gives the
  model-parallel size only; the split tp = min(8, mp), pp = mp / 8 and the head counts are the
  paper's Table 1 as recalled here, not re-read (heads change only the activation memory).
  A100 80 GB, vocabulary 51,200, sequence 2,048, fp16, full activation recomputation, TFLOP/s
  counted with the paper's eq. 3 (96·B·s·L·h²·(1 + s/6h + V/16Lh)).
MEGATRON_WEAK: Megatron-LM README (main, read 2026), images/model_table.png, added by commit
  f2e5db402c (2024-07-15, "New scaling figures on H100 GPUs", Megatron-Core r0.8.0): GPT 1.7 B–462 B,
  vocabulary 131,072, sequence 4,096, tp/pp/dp, GPUs, batch, per-GPU TFLOP/s, MFU. Communication
  overlapped (--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap, PP by default).
MEGATRON_STRONG: the same README's text: GPT-3 175 B (vocabulary 131,072) from 96 to 4,608 H100s at
  batch 1,152, MFU 47 % → 42 %. The per-point layouts and MFUs are only in a plot
  (images/strong_scaling.png, no numbers): the two end points are the checkable figures, and the
  layout is the planner's own choice (the README does not give it).
ZERO_FIG1: Rajbhandari et al., ZeRO, arXiv 1910.02054, Figure 1: Ψ = 7.5 B, N_d = 64, K = 12:
  120 GB baseline, 31.4 GB P_os, 16.6 GB P_os+g, 1.9 GB P_os+g+p per device.
GDGPT: gdGPT's README (github.com/CVI-SZU/gdGPT; the figures as quoted, not re-read here): llama-7b on
  8 × A100-40G, fp16, micro-batch 1, global batch 128, samples/s: seq 256 pipeline 56.85, ZeRO-3
  15.76; seq 1024 pipeline 24.47, ZeRO-3 out of memory.
"""
from __future__ import annotations

from dataclasses import replace

from planner import hardware as H
from planner.model import PRESETS, Model, gpt
from planner.plan import plan
from planner.steptime import Software

# (model preset, tp, pp, GPUs, batch, reported TFLOP/s per GPU)
NARAYANAN = [("gpt-1.7b", 1, 1, 32, 512, 137), ("gpt-3.6b", 2, 1, 64, 512, 138), ("gpt-7.5b", 4, 1, 128, 512, 142),
             ("gpt-18b", 8, 1, 256, 1024, 135), ("gpt-39b", 8, 2, 512, 1536, 138), ("gpt-76b", 8, 4, 1024, 1792, 140),
             ("gpt-145b", 8, 8, 1536, 2304, 148), ("gpt-310b", 8, 16, 1920, 2160, 155),
             ("gpt-530b", 8, 35, 2520, 2520, 163), ("gpt-1t", 8, 64, 3072, 3072, 163)]
NARAYANAN_SW = Software(overlap_dp=False, overlap_tp=False, overlap_pp=False, flash_attention=False)
# (name, heads, hidden, layers, tp, pp, dp, GPUs, batch, TFLOP/s per GPU, MFU %)
MEGATRON_WEAK = [("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41), ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47),
                 ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49), ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46),
                 ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42), ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43),
                 ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44), ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48),
                 ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47)]
MEGATRON_STRONG = [(96, 47), (4608, 42)]        # GPUs, MFU % ; GPT-3 175 B, batch 1,152
MEGATRON_SW = Software()
ZERO_FIG1 = {"psi": 7.5e9, "n": 64, "GB": {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}}
GDGPT = {"model": "llama-7b", "gpus": 8, "batch": 128, "samples_per_s": {(256, "pipeline"): 56.85, (256, "zero3"): 15.76,
                                                                         (1024, "pipeline"): 24.47, (1024, "zero3"): None}}


def megatron_model(name, heads, hidden, layers) -> Model:
    return gpt(f"mcore-{name}", layers, hidden, heads, vocab=131072, seq=4096, source="Megatron-LM README model_table.png")


def _best(preds):
    fits = [p for p in preds if p.fits]
    return fits[0] if fits else None


def narayanan_rows(hw=None, rows: int | None = None):
    """[{row, predicted, reported, error, layout, planner_best, ...}] for Table 1."""
    hw = hw or H.A100
    out = []
    for name, tp, pp, gpus, batch, rep in NARAYANAN[:rows]:
        m = PRESETS[name]
        fixed = {"tp": tp, "pp": pp, "recompute": "full", "zero": 0, "offload": False, "sp": False}
        p = _best(plan(m, gpus, hw, m.seq, batch, NARAYANAN_SW, fixed=fixed))
        paper_flops = m.flops_per_token(m.seq, recompute_layers=True) * batch * m.seq
        pred = paper_flops / (p.time["total"] * gpus) / 1e12 if p else float("nan")
        own = _best(plan(m, gpus, hw, m.seq, batch, NARAYANAN_SW))
        out.append({"model": name, "tp": tp, "pp": pp, "gpus": gpus, "batch": batch, "reported": rep,
                    "predicted": pred, "error": pred / rep - 1, "layout": p.layout.label() if p else "does not fit",
                    "gib": p.memory["total"] / 2**30 if p else float("nan"),
                    "best": own.layout.label() if own else "-", "best_step_s": own.time["total"] if own else float("nan"),
                    "paper_step_s": p.time["total"] if p else float("nan")})
    return out


def megatron_weak_rows(hw=None, rows: int | None = None):
    hw = hw or H.H100
    out = []
    for name, a, h, L, tp, pp, dp, gpus, batch, tf, mfu in MEGATRON_WEAK[:rows]:
        m = megatron_model(name, a, h, L)
        fixed = {"tp": tp, "pp": pp, "zero": 1, "offload": False, "recompute": "selective", "sp": tp > 1}
        p = _best(plan(m, gpus, hw, m.seq, batch, MEGATRON_SW, fixed=fixed))
        own = _best(plan(m, gpus, hw, m.seq, batch, MEGATRON_SW))
        out.append({"model": name, "tp": tp, "pp": pp, "gpus": gpus, "batch": batch, "reported_mfu": mfu,
                    "predicted_mfu": 100 * p.mfu if p else float("nan"), "reported_tflops": tf,
                    "predicted_tflops": p.tflops_per_gpu if p else float("nan"),
                    "points": (100 * p.mfu - mfu) if p else float("nan"), "layout": p.layout.label() if p else "does not fit",
                    "best": own.layout.label() if own else "-", "best_mfu": 100 * own.mfu if own else float("nan")})
    return out


def megatron_strong_rows(hw=None):
    hw = hw or H.H100
    m = replace(megatron_model("gpt3-175b", 96, 12288, 96), name="mcore-gpt3-175b")
    out = []
    for gpus, mfu in MEGATRON_STRONG:
        own = _best(plan(m, gpus, hw, m.seq, 1152, MEGATRON_SW, fixed={"zero": 1, "offload": False}))
        out.append({"model": "GPT-3 175B", "gpus": gpus, "batch": 1152, "reported_mfu": mfu,
                    "predicted_mfu": 100 * own.mfu if own else float("nan"),
                    "points": (100 * own.mfu - mfu) if own else float("nan"), "layout": own.layout.label() if own else "-"})
    return out


def host_hooks() -> float:
    """Host seconds a ZeRO-3 engine spends per module fetch or release in its Python hooks:
    cpu-here's zero3_module_s (benchmarks.planner_fit, ringzero's engine on this machine's CPU).
    The part of a ZeRO-3 step that does not depend on the accelerator: the same hooks run per
    module whatever computes the layer (assumed: DeepSpeed's hooks cost what ringzero's do, on a
    host core as fast as this one). 0 when no cpu_here.json is there to read (planner.hosts)."""
    try:
        return H.cpu_here().zero3_module_s
    except ValueError:
        return 0.0


def gdgpt_rows(hw=None):
    """Each gdGPT row predicted on the device alone ("predicted") and with the host-side work a
    step runs in Python beside it ("with host"): ZeRO-3's per-module hooks (host_hooks), which hide
    behind a micro-batch's compute only as far as it lasts (planner.steptime's ZeRO-3 overlap).
    The pipeline's host work per micro-batch and stage (DeepSpeed's PipelineEngine interpreting
    its instructions) has no measured counterpart here, so its rows are the device's alone."""
    hw = hw or H.A100_40G
    hooks = replace(hw, zero3_module_s=host_hooks())
    m = PRESETS[GDGPT["model"]]
    out = []
    for (seq, kind), rep in GDGPT["samples_per_s"].items():
        fixed = ({"tp": 1, "pp": 8, "zero": 0, "offload": False, "mb": 1, "v": 1, "recompute": "none"} if kind == "pipeline"
                 else {"tp": 1, "pp": 1, "zero": 3, "offload": False, "mb": 1, "recompute": "none"})
        preds = plan(m, 8, hw, seq, GDGPT["batch"], Software(), fixed=fixed, keep_all=True)
        p = preds[0] if preds else None
        host = plan(m, 8, hooks, seq, GDGPT["batch"], Software(), fixed=fixed, keep_all=True)[0] if kind == "zero3" else p
        out.append({"seq": seq, "layout": kind, "reported": rep, "fits": p.fits if p else False,
                    "gib": p.memory["total"] / 2**30 if p else float("nan"),
                    "predicted": GDGPT["batch"] / p.time["total"] if p else float("nan"),
                    "with_host": GDGPT["batch"] / host.time["total"] if host else float("nan")})
    return out


def calibrate(which: str) -> float:
    """The gemm_efficiency that makes the planner reproduce the first row of a table exactly:
    'a100' → Narayanan's GPT 1.7 B (137 TFLOP/s), 'h100' → Megatron's GPT 1.7 B (MFU 41 %).
    Bisection on a prediction that falls monotonically with the efficiency."""
    hw = {"a100": H.A100, "h100": H.H100}[which]
    lo, hi = 0.05, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        h = replace(hw, gemm_efficiency=mid)
        got, want = ((narayanan_rows(h, rows=1)[0]["predicted"], NARAYANAN[0][-1]) if which == "a100"
                     else (megatron_weak_rows(h, rows=1)[0]["predicted_mfu"], MEGATRON_WEAK[0][-1]))
        lo, hi = (mid, hi) if got < want else (lo, mid)
    return round((lo + hi) / 2, 4)


def gdgpt_gap(hw=None) -> dict:
    """Why gdGPT's runs are slower than predicted, read off its own rows (an explanation, not a
    prediction: nothing here feeds the planner). Pipeline (pp 8, m = 128 micro-batches of one
    sequence): a stage spends (step time) / (m + p − 1) per micro-batch; the two sequence lengths
    give it as a + b·tokens. b is the compute per token, to compare with the planner's; a is what
    a micro-batch costs whatever its size — the engine's host-side work per micro-batch and stage
    (DeepSpeed's PipelineEngine runs each instruction, p2p and kernel launch from Python), which the
    planner does not count. ZeRO-3 (dp 8, 16 micro-batches per rank): the measured step beyond the
    planner's, per module fetch or release (3 per module with parameters and micro-batch) — the
    engine's per-module hooks, the GPU counterpart of cpu-here's zero3_module_s."""
    hw = hw or H.A100_40G
    m, p, batch = PRESETS[GDGPT["model"]], 8, GDGPT["batch"]
    sps = GDGPT["samples_per_s"]
    per_mb = {seq: batch / sps[(seq, "pipeline")] / (batch + p - 1) for seq in (256, 1024)}
    b = (per_mb[1024] - per_mb[256]) / (1024 - 256)
    a = per_mb[256] - 256 * b
    fixed = {"tp": 1, "pp": 8, "zero": 0, "offload": False, "mb": 1, "v": 1, "recompute": "none"}
    pred = plan(m, 8, hw, 256, batch, Software(), fixed=fixed, keep_all=True)[0].time
    planner_b = (pred["matmul"] + pred["elementwise"]) / batch / 256
    z3 = plan(m, 8, hw, 256, batch, Software(), keep_all=True,
              fixed={"tp": 1, "pp": 1, "zero": 3, "offload": False, "mb": 1, "recompute": "none"})[0].time
    calls = 3 * (9 * m.layers + 3) * batch // 8     # a llama layer's modules with parameters: 7 linears, 2 norms
    gap = batch / sps[(256, "zero3")] - z3["total"]
    return {"per_mb_ms": {k: v * 1e3 for k, v in per_mb.items()}, "fixed_ms": a * 1e3, "per_token_us": b * 1e6,
            "planner_per_token_us": planner_b * 1e6, "zero3_gap_s": gap, "zero3_calls": calls,
            "zero3_per_call_ms": gap / calls * 1e3}
