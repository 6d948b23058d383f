"""What a training step's first run maps beyond its tensors on this machine, per layer family:
the code pages of the kernels it touches for the first time (file-backed) and the anonymous
memory the runtime keeps beside the tensors (small-block heap, autograd's graph, oneDNN/MKL
buffers) — a property of this machine's torch build, measured once and written to
planner/cpus/PROCESSOR/cpu_mem.json for planner.memory (`runtime` term of cpu-here); and the llama family's
slack per byte of the blocks a stage frees.

    python -m benchmarks.planner_mem_probe              # ~3 min idle: one process per family, llama's slack
    python -m benchmarks.planner_mem_probe --dry-run    # print, write nothing
    python -m benchmarks.planner_mem_probe --dry-run --engines    # also each engine's slack, 2-4 ranks (~4 min)
    python -m benchmarks.planner_mem_probe --vocab 4096 # llama's slack at another vocabulary beside
                                                        # the planner's (prints only)

Each family runs one process, as benchmarks.planner_local's ranks run (the same warm-up and
baseline, planner_ranks._warm), its own layer at a probe shape none of the rows uses
(L 2, h 128, 4 heads, V 2048, s 64, b 2), with glibc's mmap threshold fixed at 64 KiB so that no
freed block stays resident; three steps of AdamW; then, above the baseline at the peak: the
file pages (RssFile), and the anonymous rest less the planner's own count of the step
(planner.memory.memory, one rank); the same for the torch family's step through zero_from_scratch's
ZeRO-1 engine, one rank, less the torch family's (the engine's own runtime, "zero"). Beside them,
the same step at glibc's defaults: the slack
(defaults less mapped) as a fraction of the gradients and optimizer state, printed, as evidence
for planner.host_memory.allocator_slack (not used by it); --engines does the same for each engine of
benchmarks.planner_local at the probe shape. Memory only: the load does not enter.

llama's slack: its pipeline (benchmarks.planner_ranks._llama_pp_rank, pp 2, 4 micro-batches, 4
steps) at LLAMA_SLACK, a shape no row uses, at vocabulary 1,024 and 8,192 and micro-batch 2, 4
and 8, at the defaults and mapped; the slack of each rank (defaults less mapped) against the
planner's blocks of that rank's stage (activations, logit gradients, end matrices: what
planner.memory hands allocator_slack), both ranks: a least-squares fit without a constant gives
the bytes kept per byte of each, written for planner.host_memory.allocator_slack. --vocab N
prints the same sweep at another vocabulary beside the planner's slack as the file stands: the
check (it writes nothing; --dry-run and --engines do not apply to it).
"""
from __future__ import annotations

import argparse
import ctypes
import os
from dataclasses import replace

import numpy as np
import torch

import benchmarks.planner_ranks as R
import benchmarks.planner_ranks_tp as RT
from benchmarks.planner_local import LOCAL_SW
from benchmarks.planner_mem import snapshot
import pipeline_parallel.models.llama as LL
from pipeline_parallel.models.llama import llama_config, llama_model
from planner import hardware as H
from planner import host_memory as HM
from planner import memory as PM
from planner.layout import Layout
from planner.memory import memory
from planner.hosts import fit_path, this_cpu, writable, write_fit
from planner.model import Model
from primitives.launch import spawn
from primitives.log import console

MiB = 2**20
SHAPE = dict(layers=2, hidden=128, heads=4, vocab=2048, seq=64)
MB, STEPS = 2, 3
LLAMA_SLACK = dict(hidden_size=192, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3,
                   intermediate_size=512, vocab_size=1024, max_position_embeddings=128)
SLACK_SEQ, SLACK_MBS, SLACK_VOCABS = 128, (2, 4, 8), (1024, 8192)


def probe_model(family: str) -> Model:
    L, h, a, V, s = SHAPE.values()
    if family == "llama":
        c = _llama_cfg()
        return Model("probe-llama", L, h, a, V, s, ffn=c.intermediate_size, kv_heads=a, gated=True, bias=False, tied=False)
    return Model(f"probe-{family}", L, h, a, V, s, positions=s, family="" if family == "torch" else family)


def _llama_cfg():
    L, h, a, V, s = SHAPE.values()
    return llama_config("tiny", hidden_size=h, num_hidden_layers=L, num_attention_heads=a, num_key_value_heads=a,
                        vocab_size=V, intermediate_size=4 * h)


def _llama_rank(rank, world, steps: int):
    """HF LlamaForCausalLM (SDPA, untied head) at the probe shape, one process, AdamW."""
    base = R._warm()
    net = llama_model(_llama_cfg()).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(0, SHAPE["vocab"], (MB, SHAPE["seq"]))

    def step():
        net(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return R._timed(step, steps, base)


def _probe(rank, world, fn, args: tuple, mapped: bool, presets: dict | None = None) -> dict:
    """One rank of a probe step, glibc at its defaults or with every block of ≥ 64 KiB mapped; the
    file and shared pages it added above the baseline. `presets`: llama presets to register first."""
    if mapped:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)     # M_MMAP_THRESHOLD: no freed block stays resident
    LL.PRESETS.update(presets or {})
    LL.PRESETS["probe"] = dict(hidden_size=SHAPE["hidden"], num_hidden_layers=SHAPE["layers"], vocab_size=SHAPE["vocab"],
                               num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["heads"],
                               intermediate_size=4 * SHAPE["hidden"], max_position_embeddings=SHAPE["seq"])
    snaps = {}
    warm = R._warm

    def warm_and_read(*a):
        b = warm(*a)
        snaps["base"] = snapshot()
        return b
    R._warm = RT._warm = warm_and_read
    out = fn(rank, world, *args)
    end = snapshot()
    return {**out, "file": end["RssFile"] - snaps["base"]["RssFile"], "shm": end["RssShmem"] - snaps["base"]["RssShmem"]}


def probes():
    """(key, Model, Layout, global batch, rank function, its args): one process per layer family
    and the ZeRO engine's step on the torch family's (the runtime term), then each engine of
    benchmarks.planner_local at the probe shape (the slack)."""
    torch_m, distil, llama = (probe_model(f) for f in ("torch", "distilbert", "llama"))
    untied = replace(distil, tied=False)
    return [("torch", torch_m, Layout(1, 1, 1, mb=MB), MB, R._rank, (torch_m, MB, STEPS)),
            ("distilbert", distil, Layout(1, 1, 1, mb=MB), MB, RT._tp_rank, (distil, 1, MB, STEPS)),
            ("llama", llama, Layout(1, 1, 1, mb=MB), MB, _llama_rank, (STEPS,)),
            ("zero", torch_m, Layout(1, 1, 1, zero=1, mb=MB), MB, R._rank, (torch_m, MB, STEPS, 1)),
            ("ddp-torch", torch_m, Layout(2, 1, 1, mb=MB), 2 * MB, R._rank, (torch_m, MB, STEPS)),
            ("zero-torch", torch_m, Layout(2, 1, 1, zero=1, mb=MB), 2 * MB, R._rank, (torch_m, MB, STEPS, 1)),
            ("pipeline-torch", torch_m, Layout(1, 1, 2, mb=MB), 4 * MB, R._pp_rank, (torch_m, MB, 4, STEPS)),
            ("pipeline-llama", llama, Layout(1, 1, 2, mb=MB), 4 * MB, R._llama_pp_rank, ("probe", SHAPE["seq"], MB, 4, STEPS)),
            ("tp-distilbert", distil, Layout(1, 2, 1, mb=MB), MB, RT._tp_rank, (distil, 2, MB, STEPS)),
            ("pipeline-distilbert", untied, Layout(1, 2, 2, mb=MB), 4 * MB, RT._tp_pp_rank, (untied, 2, MB, 4, STEPS))]


def measure(engines: bool = False) -> dict:
    out = {}
    for key, m, lay, batch, fn, args in probes():
        if "-" in key and not engines:
            continue
        got = {mp: spawn(_probe, lay.gpus, args=(fn, args, mp), timeout=600) for mp in (True, False)}
        peak = {mp: max(g["peak"] for g in v) for mp, v in got.items()}
        g = max(got[True], key=lambda g: g["peak"])
        pred = memory(m, m.seq, lay, batch, H.cpu_here(lay.gpus), replace(LOCAL_SW, mapped_alloc=True))
        count = pred["total"] - pred["reserved"] - pred.get("runtime", 0.0)
        out[key] = {"file": float(g["file"]), "anon": float(g["peak"] - g["file"] - g["shm"] - count),
                    "mapped": float(peak[True]), "count": float(count), "default": float(peak[False]),
                    "lazy": float(pred["grads"] + pred["optimizer"])}
        out[key]["slack"] = (out[key]["default"] - out[key]["mapped"]) / out[key]["lazy"]
    return out


def stage_blocks(m, lay, batch) -> dict:
    """{stage: the blocks (bytes) planner.memory hands allocator_slack for it}, recorded as it counts."""
    seen, real = [], PM.allocator_slack
    PM.allocator_slack = lambda model, lay, seq, blocks, hw, micro: seen.append(blocks) or 0.0
    try:
        memory(m, SLACK_SEQ, lay, batch, H.cpu_here(2), LOCAL_SW)
    finally:
        PM.allocator_slack = real
    assert len(seen) == 2, "planner.memory counts a cpu-here pipeline's two stages, first then last"
    return dict(zip(("first", "last"), seen))


def llama_slack_sweep(vocabs=SLACK_VOCABS, steps: int = 4) -> list[dict]:
    """Per vocabulary, micro-batch of SLACK_MBS and stage (rank 0 the first, rank 1 the last): the
    measured slack (the rank's peak at the defaults less mapped), the planner's blocks of that stage,
    and its slack for them with the cpu_mem.json the planner reads."""
    out = []
    for vocab in vocabs:
        LL.PRESETS["slack-cal"] = cfg = {**LLAMA_SLACK, "vocab_size": vocab}
        m = R.llama_planner_model("slack-cal", SLACK_SEQ)
        for mb in SLACK_MBS:
            lay, args = Layout(1, 1, 2, mb=mb), ("slack-cal", SLACK_SEQ, mb, 4, steps)
            got = {mp: spawn(_probe, 2, args=(R._llama_pp_rank, args, mp, {"slack-cal": cfg}), timeout=600) for mp in (True, False)}
            blocks = stage_blocks(m, lay, 4 * mb)
            fitted = HM.llama_slack(m)
            for rank, stage in enumerate(("first", "last")):
                out.append({"vocab": vocab, "mb": mb, "stage": stage, "blocks": blocks[stage],
                            "slack": float(got[False][rank]["peak"] - got[True][rank]["peak"]),
                            "planned": sum(fitted[k] * blocks[stage][k] for k in HM.SLACK_BLOCKS) if fitted else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print only, do not write this processor's cpu_mem.json "
                    f"({fit_path('cpu_mem.json')}, planner.hosts)")
    ap.add_argument("--engines", action="store_true", help="also each engine's slack at the probe shape (printed only)")
    ap.add_argument("--vocab", type=int, default=None, help="llama's slack only, at this vocabulary (printed, nothing written)")
    a = ap.parse_args(argv)
    if a.vocab is not None and a.vocab < 1:
        ap.error(f"--vocab {a.vocab}: expected a positive vocabulary size")
    if a.vocab and (a.dry_run or a.engines):
        ap.error("--vocab prints llama's slack at that vocabulary and nothing else: drop --dry-run / --engines")
    if not (a.vocab or a.dry_run or writable(out := fit_path("cpu_mem.json"))):     # checked before minutes of probing
        ap.error(f"{out}: expected a file in a writable folder (or --dry-run)")
    sweep = llama_slack_sweep((a.vocab,) if a.vocab else SLACK_VOCABS)
    for r in sweep:
        b = r["blocks"]
        console.print(f"llama slack, {LLAMA_SLACK['hidden_size']}×{LLAMA_SLACK['num_hidden_layers']}, vocabulary {r['vocab']}, "
                      f"pp2 mb{r['mb']}, {r['stage']} stage: {r['slack'] / MiB:.1f} MiB; activations {b['activations'] / MiB:.1f}, "
                      f"logit gradients {b['logit_grads'] / MiB:.1f}, ends {b['ends'] / MiB:.1f}"
                      + (f"; the planner now {r['planned'] / MiB:.1f} ({r['planned'] / max(r['slack'], 1.0) - 1:+.0%})"
                         if r["planned"] is not None else ""), highlight=False)
    if a.vocab:
        return 0
    factors, *_ = np.linalg.lstsq(np.array([[r["blocks"][k] for k in HM.SLACK_BLOCKS] for r in sweep]),
                                  np.array([r["slack"] for r in sweep]), rcond=None)
    fit = dict(zip(HM.SLACK_BLOCKS, map(float, factors)))
    console.print("llama slack per byte (least squares, no constant): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in fit.items()), highlight=False)
    got = measure(a.engines)
    for key, v in got.items():
        console.print(f"{key}: mapped {v['mapped'] / MiB:.1f} MiB, planner's count {v['count'] / MiB:.1f}, "
                      f"file pages {v['file'] / MiB:.2f}, anonymous beyond the count {v['anon'] / MiB:.2f}; "
                      f"at glibc's defaults {v['default'] / MiB:.1f}: slack {(v['default'] - v['mapped']) / MiB:.1f} = "
                      f"{v['slack']:.2f} of grads + optimizer", highlight=False)
    if not a.dry_run:
        fam = ("torch", "distilbert", "llama")
        runtime = {k: {"file": got[k]["file"], "anon": got[k]["anon"]} for k in fam}
        # the ZeRO engine's own: its step beside torch's same step, one rank (no transport, no scratch)
        runtime["zero"] = {k: got["zero"][k] - got["torch"][k] for k in ("file", "anon")}
        doc = {"runtime": runtime,
               "slack": {"llama": {**fit, "shape": {k: v for k, v in LLAMA_SLACK.items() if k != "vocab_size"},
                                   "seq": SLACK_SEQ, "micro_batches": list(SLACK_MBS), "vocabularies": list(SLACK_VOCABS)}},
               "source": "python -m benchmarks.planner_mem_probe", "shape": SHAPE, "cpu": this_cpu()}
        write_fit(fit_path("cpu_mem.json"), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
