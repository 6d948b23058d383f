"""Where a pipeline stage's CPU seconds go: the pipeline engine's step against the same stage's layers
run alone, back to back in the same ranks, beside the planner's count of each part.

    python -m benchmarks.planner_pipe_cpu                     # llama-tiny, pp 2, 4 micro-batches of 2 (~1 min)
    python -m benchmarks.planner_pipe_cpu --preset small --rounds 10

Each of the 2 ranks builds benchmarks.planner_local's llama row (planner_ranks.llama_pp_engine) and,
for --rounds rounds, reads the speed of a CPU second (planner.probe.Rate, as the rows do), runs one
engine step, then its own stage's chunk forward + backward for the step's micro-batches, one after
another, alone (no sends, no optimizer; the gradients cleared after, as the engine's step leaves
them). CPU seconds of the rank's thread throughout. The engine's step is split by its executor's
instruction kinds: forward + backward; the step op (pipeline_parallel/engine/step.py: the gradient
norm where clipping asks, the status all-reduce, the optimizer's step, of it timed apart, and
zero_grad); the rest (everything else train_batch does: receives with their waits, sends, shape
headers, the reductions, the engine's bookkeeping). A pair taken back to back shares the machine's
speed, which moves within seconds on a shared guest, so each ratio is read per round and its median
printed. Beside them the planner's terms for the rank's stage at the rounds' speed: its layers' CPU
per step (matmul, elementwise at the fit's rates; the last stage with its head) and the optimizer
term (Ψ / host_adam at step_cpu). What the planner does not count shows as the gaps.
Cost: 2 ranks × --rounds × (a step + its micro-batches alone + a 0.2 s speed reading).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from dataclasses import replace

import torch
from rich.table import Table

from benchmarks.planner_ranks import llama_planner_model, llama_pp_engine
from pipeline_parallel.models.llama import llama_config, llama_loss
from planner import hardware as H
from planner.cpu_host import pipeline_stretch
from planner.layout import Layout
from planner.probe import Rate
from planner.steptime import step_time
from primitives.launch import spawn
from primitives.log import console

SEQ, MB, MICRO = 128, 2, 4


def _rank(rank, world, preset: str, rounds: int) -> dict:
    engine, one_step, x = llama_pp_engine(rank, world, preset, SEQ, MB, MICRO)
    ex, chunk, last = engine.executor, engine.executor.chunks[0], rank == world - 1
    cpu, do, adam = collections.Counter(), ex.do, engine.optimizer.step

    def timed_do(op):                  # the executor's instructions, each's CPU seconds by kind
        c0 = time.thread_time()
        do(op)
        cpu[op.kind] += time.thread_time() - c0

    def timed_adam(*args, **kwargs):   # the optimizer's own step, inside the step op
        c0 = time.thread_time()
        out = adam(*args, **kwargs)
        cpu["adam"] += time.thread_time() - c0
        return out
    ex.do, engine.optimizer.step = timed_do, timed_adam
    received = torch.randn(MB, SEQ, llama_config(preset).hidden_size, requires_grad=True) if last else None

    def alone():                       # the stage's micro-batches, forward + backward, nothing else
        for _ in range(MICRO):
            if last:
                llama_loss(chunk(received), x).backward()
            else:
                chunk(x).sum().backward()

    def clear():                       # the engine's step starts from no gradients, as after its own step
        for p in [*chunk.parameters(), *([received] if last else [])]:
            p.grad = None
    reader = Rate(cpu_s=0.2)
    for _ in range(2):
        one_step()
        alone()
        clear()
    rows = []
    for _ in range(rounds):
        rate = reader.read()
        cpu.clear()
        c0 = time.thread_time()
        one_step()
        step = time.thread_time() - c0
        c0 = time.thread_time()
        alone()
        solo = time.thread_time() - c0
        clear()
        rows.append({"rate": rate, "step": step, "fwd_bwd": cpu["fwd"] + cpu["bwd"], "step_op": cpu["step"], "adam": cpu["adam"],
                     "rest": step - cpu["fwd"] - cpu["bwd"] - cpu["step"], "alone": solo})
    return {"rows": rows, "params": sum(p.numel() for p in chunk.parameters())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=("tiny", "small"), help="pipeline_parallel.models.llama's preset")
    ap.add_argument("--rounds", type=int, default=20, help="engine steps, each followed by the stage alone (at least 3)")
    a = ap.parse_args(argv)
    if a.rounds < 3:
        ap.error(f"--rounds {a.rounds}: expected at least 3 (the medians)")
    got = spawn(_rank, 2, args=(a.preset, a.rounds), timeout=900)
    model, lay = llama_planner_model(a.preset, SEQ), Layout(1, 1, 2, mb=MB)
    fit = H.cpu_here(2)
    at = fit.peak_flops * fit.gemm_efficiency
    t = Table(title=f"llama-{a.preset} pp2 1F1B m{MICRO} mb{MB}: CPU ms per step, the median of {a.rounds} rounds")
    for c in ("rank", "engine step", "fwd + bwd", "step op", "of it Adam", "rest", "layers alone", "engine / alone",
              "fwd+bwd / alone", "planner: layers", "planner: optimizer"):
        t.add_column(c, justify="right")
    for rank, g in enumerate(got):
        rows = g["rows"]
        med = lambda k: statistics.median(r[k] for r in rows) * 1e3      # noqa: E731
        ratio = lambda k: statistics.median(r[k] / r["alone"] for r in rows)   # noqa: E731
        speed = statistics.harmonic_mean(r["rate"] for r in rows) / at
        hw = replace(H.at_speed(fit, speed), cores=0)      # step_time applies per_step itself
        terms = step_time(model, SEQ, lay, MB * MICRO, hw)
        layers = (terms["matmul"] + terms["elementwise"] + terms["allocator"]) / pipeline_stretch(lay, hw)
        t.add_row(f"{rank} ({'last' if rank else 'first'})", f"{med('step'):.1f}", f"{med('fwd_bwd'):.1f}", f"{med('step_op'):.1f}",
                  f"{med('adam'):.1f}", f"{med('rest'):.1f}", f"{med('alone'):.1f}", f"{ratio('step'):.2f}", f"{ratio('fwd_bwd'):.2f}",
                  f"{layers * 1e3:.1f}" if rank else "", f"{g['params'] / H.per_step(hw).host_adam * 1e3:.1f}")
    console.print(t)
    console.print("planner: layers is the pacing (last) stage's; the optimizer term is Ψ of each rank's stage over host_adam "
                  f"at the rounds' speed and step_cpu ({H.CPU_HERE})", highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
