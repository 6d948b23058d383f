"""ringzero ZeRO vs DeepSpeed ZeRO (and torch DDP as the floor): step time, peak RSS, start-up.

    python benchmarks/zero_vs_deepspeed.py                 # the full run: DistilBERT-base shape
        (Ψ = 66,955,010, random init), 2 ranks, micro-batch 8, seq 128, fp32 and bf16, stages 1-3,
        5 timed steps after 1 warm-up, 1 thread per rank: ~25-40 min on 2 quiet cores
    python benchmarks/zero_vs_deepspeed.py --quick         # tiny DistilBERT, fp32, 2 steps: proves it runs (~2 min)
    python benchmarks/zero_vs_deepspeed.py --stages 2 --dtypes fp32 --steps 8 --json zero2.json
    python benchmarks/zero_vs_deepspeed.py --stages 2 3 --overlap on      # overlap_comm: true on both sides

--overlap off|on (default both): each row says overlap_comm false or true, set identically on both
sides; ratios compare ours and DeepSpeed at the same setting. For ours, "comm hidden" is the
part of the asynchronous collectives' run time that finished before anyone waited for it (i.e.
ran while backward / the previous module computed), out of their total, on the last step.

Every configuration (engine × stage × dtype) runs in its own fresh set of ranks (primitives
spawn, gloo), so each peak RSS (VmHWM, per rank) and each launch → first-step time is its own.
Configurations are interleaved — for each stage and dtype, ours then DeepSpeed (the order flips
each repeat) — so slow drift of a shared machine hits both sides alike. torch DDP (fp32, AdamW,
same clipping) runs once per repeat as the reference. torch.set_num_threads and OMP_NUM_THREADS
are set to --threads on every side. DeepSpeed runs with "torch_adam": true (torch.optim.AdamW, as
ours and DDP) and without its shm comm op (inference-only), so nothing is JIT-built.
Cost: (2 × stages × dtypes + 1) × repeats × (start-up + (steps + warmup) × step) wall time.
Numbers on a shared machine are indicative (±30 %): re-run on a quiet one for the README.
Peak RSS includes what every spawned rank inherits from the forkserver (torch and torch._dynamo
imported: primitives.launch._preload), the same on every side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


import torch  # noqa: E402
from parity.zero.sides import peak_rss_bytes
from parity.zero.sides import make_engine
from zero_from_scratch.engine.models import tiny_distilbert
from zero_from_scratch.engine.atomic import atomic_write
from torch.nn.parallel import DistributedDataParallel
from rich.table import Table
from primitives.log import console
from primitives.launch import spawn

GIB = 2 ** 30


def build(model: str):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification  # optional dependency
    if model == "distilbert-base":
        cfg = DistilBertConfig(dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)  # Ψ = 66,955,010
        return DistilBertForSequenceClassification(cfg)
    if model == "tiny":
        return tiny_distilbert(vocab=1000, hidden=64, max_positions=512)
    raise ValueError(f"model must be distilbert-base or tiny, got {model!r}")


def ds_config(stage: int, bf16: bool, micro: int, bucket: int = int(5e8), overlap: bool = False) -> dict:
    """DeepSpeed's defaults where they matter (5e8-element buckets unless --bucket), AdamW via torch."""
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10 ** 9, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                  "overlap_comm": overlap, "contiguous_gradients": True}}


def bench_rank(rank, world, engine, stage, dtype, model, micro, seq, steps, warmup, t_launch, threads,
               bucket=int(5e8), overlap=False):
    """spawn target: build, wrap, train warmup + steps; return timings and this rank's peak RSS."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = build(model)
    g = torch.Generator().manual_seed(rank)
    vocab = m.config.vocab_size
    batch = {"input_ids": torch.randint(0, vocab, (micro, seq), generator=g),
             "attention_mask": torch.ones(micro, seq, dtype=torch.long),
             "labels": torch.randint(0, 2, (micro,), generator=g)}
    if engine == "ddp":
        e = DistributedDataParallel(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01)

        def one_step():
            loss = e(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        e = make_engine("deepspeed" if engine == "deepspeed" else "ours", m, m.parameters(),
                        ds_config(stage, dtype == "bf16", micro, bucket, overlap), "primitives")

        def one_step():
            loss = e(**batch).loss
            e.backward(loss)
            e.step()
    times, t_first = [], None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
        if t_first is None:
            t_first = time.time() - t_launch
    hidden = comm = None
    if engine == "ours":
        ov = e.comm_report(print_table=False)["overlap"]
        hidden = sum(r["hidden_ms"] for r in ov)
        comm = sum(r["finished_ms"] - r["started_ms"] for r in ov)
    return {"times": times[warmup:], "first": t_first, "rss": peak_rss_bytes(), "hidden_ms": hidden, "comm_ms": comm}


def run_one(engine, stage, dtype, a, overlap=False):
    t0 = time.time()
    res = spawn(bench_rank, a.world_size, timeout=a.timeout, comm_timeout=600.0, threads=a.threads,
                args=(engine, stage, dtype, a.model, a.micro_batch, a.seq, a.steps, a.warmup, t0, a.threads,
                      int(a.bucket), overlap))
    step = [max(r["times"][i] for r in res) for i in range(a.steps)]  # a step ends when the slowest rank ends
    return {"engine": engine, "stage": stage, "dtype": dtype, "overlap": overlap, "step_s": step,
            "rss_gib": [r["rss"] / GIB for r in res], "first_s": max(r["first"] for r in res),
            "hidden_ms": res[0]["hidden_ms"], "comm_ms": res[0]["comm_ms"]}


def summarize(runs):
    """One row per (engine, stage, dtype): median over every timed step of every repeat."""
    groups = {}
    for r in runs:
        groups.setdefault((r["engine"], r["stage"], r["dtype"], r.get("overlap", False)), []).append(r)
    out = {}
    for k, rs in groups.items():
        steps = [s for r in rs for s in r["step_s"]]
        out[k] = {"median_s": statistics.median(steps), "min_s": min(steps), "max_s": max(steps),
                  "peak_rss_gib": max(max(r["rss_gib"]) for r in rs),
                  "first_s": statistics.median(r["first_s"] for r in rs),
                  "hidden": (f"{rs[-1]['hidden_ms']:.0f} of {rs[-1]['comm_ms']:.0f} ms"
                             if rs[-1].get("comm_ms") else "")}
    return out


def table(summary, a):
    ddp = summary.get(("ddp", 0, "fp32", False))
    t = Table(title=f"ZeRO: ours vs DeepSpeed — {a.model}, {a.world_size} ranks, micro-batch {a.micro_batch}, "
                    f"seq {a.seq}, {a.threads} thread(s)/rank, median of {a.steps}×{a.repeats} steps")
    for c in ("stage", "dtype", "overlap_comm", "engine", "step s (min–max)", "ours / DeepSpeed", "ours / DDP",
              "peak RSS / rank", "launch → 1st step", "comm hidden (ours)"):
        t.add_column(c, justify="right")
    for (eng, st, dt, ov), v in sorted(summary.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3],
                                                                         kv[0][0] != "ours")):
        ratio_ds = ratio_ddp = ""
        if eng == "ours":
            ds = summary.get(("deepspeed", st, dt, ov))
            ratio_ds = f"{v['median_s'] / ds['median_s']:.2f}×" if ds else ""
            ratio_ddp = f"{v['median_s'] / ddp['median_s']:.2f}×" if ddp and dt == "fp32" else ""
        t.add_row(str(st) if eng != "ddp" else "DDP", dt, "on" if ov else "off", eng,
                  f"{v['median_s']:.3f} ({v['min_s']:.3f}–{v['max_s']:.3f})", ratio_ds, ratio_ddp,
                  f"{v['peak_rss_gib']:.2f} GiB", f"{v['first_s']:.1f} s", v["hidden"])
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, seq 32, 2 steps, fp32 only: a smoke run")
    ap.add_argument("--model", choices=("distilbert-base", "tiny"), default=None)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=(1, 2, 3))
    ap.add_argument("--dtypes", nargs="+", default=None, choices=("fp32", "bf16"), help="default fp32 bf16 (--quick fp32)")
    ap.add_argument("--engines", nargs="+", default=["ours", "deepspeed"], choices=("ours", "deepspeed"))
    ap.add_argument("--no-ddp", action="store_true", help="skip the torch DDP reference")
    ap.add_argument("--overlap", nargs="+", default=["off", "on"], choices=("off", "on"),
                    help="overlap_comm setting(s), the same on both sides (default: both rows)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default 128, --quick 32)")
    ap.add_argument("--bucket", type=float, default=5e8,
                    help="reduce/allgather_bucket_size in elements, both engines (DeepSpeed's default 5e8 "
                         "makes DistilBERT-base one bucket, so stage 2 holds a full-size gradient bucket)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 5, --quick 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch / OMP threads per rank, the same on every side")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--json", default=None, help="write every run and the summary here")
    a = ap.parse_args(argv)
    a.model = a.model or ("tiny" if a.quick else "distilbert-base")
    a.seq = a.seq or (32 if a.quick else 128)
    a.steps = a.steps or (2 if a.quick else 5)
    a.dtypes = a.dtypes or (["fp32"] if a.quick else ["fp32", "bf16"])
    for k in ("world_size", "micro_batch", "seq", "steps", "repeats", "threads"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be ≥ 1, got {getattr(a, k)}")
    if a.warmup < 0:
        ap.error(f"--warmup must be ≥ 0, got {a.warmup}")
    psi = sum(p.numel() for p in build(a.model).parameters())
    console.print(f"model {a.model}: Ψ = {psi:,} parameters; {a.world_size} ranks × {a.threads} thread(s); "
                  f"{os.cpu_count()} CPU cores visible")
    runs = []
    for rep in range(a.repeats):
        for dtype in a.dtypes:
            for stage in a.stages:
                for ov in a.overlap:
                    order = a.engines if rep % 2 == 0 else a.engines[::-1]
                    for eng in order:
                        console.print(f"[dim]repeat {rep + 1}/{a.repeats}: {eng} ZeRO-{stage} {dtype} "
                                      f"overlap_comm {ov} …[/]")
                        runs.append(run_one(eng, stage, dtype, a, ov == "on"))
                        r = runs[-1]     # printed as it comes: a long run cut short still says something
                        console.print(f"  → {statistics.median(r['step_s']):.3f} s/step, peak RSS "
                                      f"{max(r['rss_gib']):.2f} GiB/rank")
        if not a.no_ddp:
            console.print(f"[dim]repeat {rep + 1}/{a.repeats}: torch DDP fp32 …[/]")
            runs.append(run_one("ddp", 0, "fp32", a))
    summary = summarize(runs)
    console.print(table(summary, a))
    if a.json:
        doc = {"args": vars(a), "psi": psi, "runs": runs,
               "summary": [{"engine": k[0], "stage": k[1], "dtype": k[2], "overlap": k[3], **v} for k, v in summary.items()]}
        atomic_write(a.json, lambda f: f.write(json.dumps(doc, indent=1).encode()))
        console.print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
