"""What a CPU host's rank keeps resident beyond the tensors planner.memory counts (cpu-here):
the runtime's pages per layer family and glibc's slack.

    python -m benchmarks.planner_mem_probe      # measures the runtime's pages into planner/cpu_mem.json
    python -m benchmarks.planner_mem            # a measured peak split into its parts

Cost: one JSON read, cached.
"""
from __future__ import annotations

import functools
import json
import os

from planner.model import Model
from zero_from_scratch.engine.ledger import model_state_bytes

CPU_MEM = os.path.join(os.path.dirname(__file__), "cpu_mem.json")     # written by python -m benchmarks.planner_mem_probe
SLACK_CAL = Model("gpt-cal", 3, 192, 4, 12288, 128, positions=128)   # benchmarks.planner_fit's calibration shape (CAL)


def family(model) -> str:
    """The layer family a CPU host runs (torch_layer_activation_bytes's dispatch): torch, distilbert, llama."""
    return "llama" if model.gated else (model.family or "torch")


@functools.lru_cache(maxsize=None)
def _cpu_mem() -> dict:
    if not os.path.exists(CPU_MEM):
        return {}
    with open(CPU_MEM) as f:
        return json.load(f)["runtime"]


def runtime_bytes(model) -> float:
    """Resident bytes a rank's first steps add beyond its tensors, a property of this machine's torch
    build per layer family (benchmarks.planner_mem_probe, one process at a probe shape): the code
    pages of the kernels the family touches after the warm-up (RssFile) and the anonymous memory
    the runtime keeps beside the tensors (small-block heap, the autograd graph, oneDNN/MKL
    buffers). 0 when not probed."""
    got = _cpu_mem().get(family(model))
    return float(got["file"] + got["anon"]) if got else 0.0


def allocator_slack(lay, states: dict, hw) -> float:
    """Bytes glibc keeps resident beyond the live tensors at its defaults: the holes its heap
    keeps among the model states a rank's first step creates (gradients, then the optimizer's m, v,
    placed between transient blocks once the dynamic mmap threshold has risen; the peak stays
    there even with the threshold fixed and the top of the heap trimmed, so it is not the trim
    bound). Calibrated by benchmarks.planner_fit on SLACK_CAL's DDP step (Hardware.alloc_slack;
    alloc_slack_zero on its ZeRO-1 step for zero_from_scratch's ZeRO-1/2 engine) and scaled by
    this stage's model-state bytes over the calibration step's, never above the calibrated bytes.
    Measured (benchmarks.planner_mem, defaults less mapped): llama tiny's stage, 1/35 of the
    calibration's state, kept 1.2 MiB (1/40 of its slack); gpt-small, 4.6× the state, kept 90 MiB
    (1.6×); the slack is neither constant nor proportional, and this rule is the nearest of the
    two to both, chosen after seeing the rows of benchmarks.planner_local. Not the height the
    dynamic mmap threshold reaches: fixed at its 32 MiB ceiling (benchmarks.planner_slack --risen)
    llama-small kept the same 18.7 MiB; gpt-small kept 92, and 41 or 90 at the defaults from run to
    run and between ranks doing the same work, so no one number per layout holds it. The 90 is one
    step's: step by step gpt-small's peak is 468-482 MiB, and in some runs one step (the 3rd of 4,
    the 6th of 8) reaches 516-530 on one rank or both; with malloc in one arena (MALLOC_ARENA_MAX=1)
    too, so it is not which thread's arena a block came from (benchmarks.planner_slack --steps,
    --arenas). Nor the activations: over 6 steps llama-small (40 MiB of them) kept 18.7 MiB where
    gpt-mini dp2 (41) kept 58 and gpt-mini pp2 (15) kept 66; from micro-batch 2 to 8 DistilBERT
    tp2's grew 23.5 -> 69.8 MiB, gpt-mini dp2's 59.4 -> 81.2, gpt-mini pp2's fell 55.7 -> 44.8.
    """
    engine = lay.zero in (1, 2) and hw.alloc_slack_zero     # zero_from_scratch's engine, not torch's DDP step
    slack = hw.alloc_slack_zero if engine else hw.alloc_slack
    cal = model_state_bytes(1 if engine else 0, SLACK_CAL.params(), 2, False)     # its 2 ranks, fp32
    here = states["params"] + states["grads"] + states["optimizer"]
    return slack * min(1.0, here / sum(cal.values()))
