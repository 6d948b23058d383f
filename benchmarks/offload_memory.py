"""optimizer offload (nvme, cpu) vs none: peak RSS per rank and bytes moved per step, DistilBERT-base shape.

    python benchmarks/offload_memory.py                    # Ψ = 66,955,010, 2 ranks, ZeRO-2 bf16, ~3-6 min
    python benchmarks/offload_memory.py --quick            # tiny DistilBERT: proves it runs (~1 min)
    python benchmarks/offload_memory.py --offloads none,cpu --steps 2      # cpu offload's bytes moved

Each configuration runs in its own fresh pair of ranks (primitives spawn, gloo), so each peak RSS
(VmHWM, per rank) is its own; the two are interleaved (none, nvme, none, nvme with --repeats 2).
Micro-batch 2 × seq 32 keeps activations small next to the model states. Expected saving per rank:
the optimizer states K·Ψ/N with K = 12 (fp32 master + Adam m + v, bf16 run) minus the three
staging buffers (3 × 4 × min(sub_group_size, 2^20) bytes); the bar: saving ≥ 0.8 × 12Ψ/N. Peak RSS
is VmHWM above the rank's RSS once the model is built, glibc's allocator at its defaults.
Bytes moved per step are counted by the offload itself: nvme read + written (expected 2·12·P/N),
cpu gradients down + parameters up (expected 2·b·P/N, b = 2 in bf16). On this CPU-only machine
the cpu offload's copies are host → host and its states were on the host anyway, so its RSS row
shows the cost of the separate host master, not a saving (that is device memory). Step times are shown
for the trade, not as a claim: the machine is shared and the files sit in the page cache.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


import torch  # noqa: E402
import zero_from_scratch
from parity.zero.sides import peak_rss_bytes
from zero_from_scratch.engine.models import tiny_distilbert
from rich.table import Table
from primitives.log import console
from primitives.launch import spawn

MIB = 2 ** 20


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _run(rank, world, model, off, path, steps, sub):
    torch.manual_seed(0)
    if model == "distilbert-base":
        from transformers import DistilBertConfig, DistilBertForSequenceClassification  # optional dependency
        m = DistilBertForSequenceClassification(DistilBertConfig())
    else:
        m = tiny_distilbert()
    base = _rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                      # VmHWM := VmRSS: the peak above the built model
    z = {"stage": 2, "sub_group_size": sub}
    if off == "nvme":
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    elif off == "cpu":
        z["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
           "zero_optimization": z, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zero_from_scratch.initialize(model=m, config=cfg)
    g = torch.Generator().manual_seed(rank)
    times = []
    vocab = m.config.vocab_size
    for _ in range(steps):
        t = time.perf_counter()
        loss = engine(input_ids=torch.randint(1, vocab, (2, 32), generator=g),
                      labels=torch.randint(0, 2, (2,), generator=g)).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
    o = engine.offload
    moved = 0 if o is None else (o.bytes_read + o.bytes_written if off == "nvme" else o.bytes_down + o.bytes_up)
    return {"rss": peak_rss_bytes() - base, "psi": engine.layout.numel, "padded": engine.layout.padded,
            "step_s": statistics.median(times[1:] or times), "moved": moved / steps, "chunk": o.chunk if o else 0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--sub-group-size", type=int, default=1_000_000_000)   # DeepSpeed's default
    ap.add_argument("--offloads", default="none,nvme", help="comma-separated: none, nvme, cpu (none is required)")
    a = ap.parse_args(argv)
    offs = a.offloads.split(",")
    if "none" not in offs or set(offs) - {"none", "nvme", "cpu"}:
        ap.error(f"--offloads {a.offloads!r}: a comma-separated subset of none,nvme,cpu that includes none")

    model, n = ("distilbert-tiny" if a.quick else "distilbert-base"), 2
    rows = {o: [] for o in offs}
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as d:
        for rep in range(a.repeats):
            for off in offs:
                res = spawn(_run, n, timeout=1200.0, args=(model, off, os.path.join(d, f"{rep}"), a.steps,
                                                        a.sub_group_size))
                rows[off].append(res)
    psi = rows["none"][0][0]["psi"]
    t = Table(title=f"{model} (Ψ={psi:,}), N={n}, ZeRO-2 bf16, sub_group_size={a.sub_group_size:,}: peak RSS above "
                    f"the built model per rank (MiB), {torch.__version__}, {os.cpu_count()} shared cores")
    for c in ("offload", "rank 0", "rank 1", "median step s", "moved per step (MiB)"):
        t.add_column(c, justify="right")
    for off, reps in rows.items():
        for res in reps:
            t.add_row(off, *[f"{r['rss'] / MIB:,.0f}" for r in res], f"{res[0]['step_s']:.2f}",
                      f"{res[0]['moved'] / MIB:,.1f}")
    console.print(t)
    padded = rows["none"][0][0]["padded"]
    if "nvme" in rows:
        goal = 0.8 * 12 * psi / n
        saved = [min(rows["none"][i][r]["rss"] for i in range(a.repeats)) - max(rows["nvme"][i][r]["rss"] for i in range(a.repeats))
                 for r in range(n)]
        console.print(f"saved per rank: {', '.join(f'{s / MIB:,.0f} MiB' for s in saved)}; 12Ψ/N = {12 * psi / n / MIB:,.0f} MiB, "
                      f"goal 0.8 × 12Ψ/N = {goal / MIB:,.0f} MiB: {'MET' if all(s >= goal for s in saved) else 'NOT met'}; "
                      f"expected moved per step 2 × 12·P/N = {2 * 12 * padded / n / MIB:,.1f} MiB")
    if "cpu" in rows:   # bf16 run: 2 bytes per gradient element down, 2 per parameter element up
        console.print(f"cpu offload: expected moved per step 2 × 2·P/N = {2 * 2 * padded / n / MIB:,.1f} MiB "
                      f"(P = {padded:,})")
    for off in offs[1:]:
        console.print(f"step time {off} / none: {rows[off][0][0]['step_s'] / rows['none'][0][0]['step_s']:.2f}")


if __name__ == "__main__":
    main()
