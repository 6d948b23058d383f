"""Pipeline (1F1B, interleaved) vs ZeRO-3 (ours, DeepSpeed's) vs ZeRO-3 + hpZ on one llama-shaped model and
one global batch: samples/s and peak memory per rank, across sequence lengths.

    python benchmarks/pipeline_vs_zero.py --seqs 64 256 --rounds 2      # tutorial 09's table (small preset)
    python benchmarks/pipeline_vs_zero.py --quick                       # tiny preset, seq 32 64, 1 round: a smoke run

Every side runs on 2 ranks (gloo, 1 thread each) in fresh processes, so a process's peak resident
memory (VmHWM, /proc/self/status) is that side's alone: pipeline = pp 2 with m micro-batches of
b (interleaved: 2 virtual stages per rank, Megatron's schedule, bubble halved); ZeRO = dp 2 with b per rank and m/2 accumulation steps — the same b·m samples per optimizer
step. Rounds are interleaved (pipeline, interleaved, ours ZeRO-3, DeepSpeed ZeRO-3, hpZ, pipeline, …) so
machine load hits every side alike; each spawn times `steps` steps after one warm-up. Reported:
median samples/s over rounds and max peak RSS over ranks. Traffic per step (per rank): ZeRO-3
moves 3(N−1)/N·Ψ parameters (2 all-gathers + 1 reduce-scatter); the pipeline 2·m·b·s·h
activations across its one boundary — independent of Ψ. Cost: sides × rounds × seqs spawns.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from rich.table import Table

import zero_from_scratch
from figures.ch09_pipeline import machine
from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.models import llama_layers, llama_loss, llama_model
from primitives.launch import spawn
from primitives.log import console
from parity.zero.sides import prepare_deepspeed

SIDES = ("pipeline 1F1B", "pipeline interleaved", "ours ZeRO-3", "DeepSpeed ZeRO-3", "ours ZeRO-3 + hpZ")


def vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def batches(rank, n, b, seq, vocab):
    g = torch.Generator().manual_seed(rank)
    return [(ids, ids.clone()) for ids in (torch.randint(0, vocab, (b, seq), generator=g) for _ in range(n))]


def config(b, ga, zero, **extra):
    return {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": ga, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": zero,
            **extra}


def side(rank, world, name, preset, seq, b, m, steps):
    model = llama_model(preset).train()
    vocab = model.config.vocab_size
    if name.startswith("pipeline"):
        net = PipelineModule(llama_layers(model), num_stages=2, loss_fn=llama_loss)
        sched = {"pipeline": {"schedule": "interleaved", "virtual_stages": 2}} if "interleaved" in name else {}
        engine = initialize(model=net, config=config(b, m, {"stage": 0}, **sched))[0]
        data = batches(rank, m, b, seq, vocab)
        run = lambda: engine.train_batch(iter(data))   # noqa: E731
    else:
        zero = {"stage": 3, **({"zero_hpz_partition_size": 2} if "hpZ" in name else {})}
        cfg = config(b, m // 2, zero)
        if name.startswith("DeepSpeed"):
            ds = prepare_deepspeed()
            ds.init_distributed(dist_backend="gloo")
            engine = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        else:
            engine = zero_from_scratch.initialize(model=model, config=cfg)[0]
        data = batches(rank, m // 2, b, seq, vocab)

        def run():
            for ids, labels in data:
                engine.backward(engine(input_ids=ids, labels=labels).loss)
                engine.step()
    run()                                                   # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - t0) / steps, vm_hwm_mib()


def moved_mib(name: str, psi: int, h: int, seq: int, b: int, m: int, n: int = 2) -> float:
    """Data bytes one rank sends per optimizer step, by the formula (fp32): the pipeline's one boundary carries
    m activations (stage 0 → 1) and m gradients (1 → 0) of b·s·h each — m·b·s·h per rank, whatever Ψ is
    (interleaved, v = 2: the chain of p·v = 4 chunks crosses ranks p·v − 1 = 3 times, 3× that); ZeRO-3 all-gathers Ψ in forward and in backward and
    reduce-scatters the gradients, 3(N−1)/N·Ψ per micro-step, m/N micro-steps per rank (hpZ at N = 2: the
    same; its secondary copy saves the backward all-gather only across nodes)."""
    if name.startswith("pipeline"):
        v = 2 if "interleaved" in name else 1
        per = m * b * seq * h * 2 * (n * v - 1) / n
    else:
        per = (m // n) * 3 * (n - 1) / n * psi
    return per * 4 / 2 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="= --preset tiny --seqs 32 64 --steps 1 --rounds 1")
    a = ap.parse_args(argv)
    if a.quick:
        a.preset, a.seqs, a.steps, a.rounds = "tiny", [32, 64], 1, 1
    b, m = a.micro_batch_size, a.micro_batches
    res = {}
    for _ in range(a.rounds):
        for seq in a.seqs:
            for name in SIDES:
                try:
                    out = spawn(side, 2, args=(name, a.preset, seq, b, m, a.steps), timeout=900)
                    res.setdefault((seq, name), []).append((max(o[0] for o in out), max(o[1] for o in out)))
                except Exception as e:                                    # a side that cannot run says why
                    res.setdefault((seq, name), []).append((float("nan"), float("nan")))
                    console.print(f"[yellow]{name} seq {seq}: {type(e).__name__}: {str(e)[-300:]}[/yellow]")
    t = Table(title=f"llama {a.preset}, global batch {b * m} ({m} × {b}), 2 ranks, {a.rounds} interleaved rounds — "
                    f"{machine()}")
    for col in ("seq", "side", "samples/s (median)", "× pipeline", "peak RSS per rank (MiB)",
                "sent per rank per step (MiB, formula)"):
        t.add_column(col)
    model = llama_model(a.preset)
    psi, h = sum(p.numel() for p in model.parameters()), model.config.hidden_size
    for seq in a.seqs:
        base = statistics.median(b * m / s for s, _ in res[(seq, SIDES[0])])
        for name in SIDES:
            sps = statistics.median(b * m / s for s, _ in res[(seq, name)])
            t.add_row(str(seq), name, f"{sps:.2f}", f"{sps / base:.2f}", f"{max(r for _, r in res[(seq, name)]):.0f}",
                      f"{moved_mib(name, psi, h, seq, b, m):.1f}")
    console.print(t)
    console.print(f"Ψ = {psi:,} parameters, h = {h}; load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
