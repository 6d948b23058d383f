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
SLACK_CAL = Model("gpt-cal", 3, 192, 4, 12288, 128, positions=128)   # benchmarks.planner_fit_engine's calibration shape (CAL)


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
    """Bytes glibc keeps resident beyond the live tensors at its defaults: free chunks below the
    heap's highest point in a step (benchmarks.planner_slack_replay). Torch asks for every tensor
    with posix_memalign (64 bytes); glibc's memalign takes size + alignment + MINSIZE from its bins
    and splits the chunk it gets, so a freed tensor's chunk serves the next request of its own size
    only once merged with a free neighbour, and the runtime's small blocks, carved from the
    fragments, keep neighbours apart: the step's heap top rises above its live peak. With the heap
    trimmed after every step (planner_slack --trim) llama-small pp2 keeps its slack, each step makes
    it anew, and gpt-small dp2 keeps a fifth of it: there the rest is earlier steps' free pages.
    Replaying a rank's logged calls through glibc reproduces its peak; the same calls unaligned keep
    8-43 % of the slack, without the small blocks 23-62 %; with glibc's mmap threshold raised before
    the first call rather than rising as the run's did, llama-small's unaligned replay keeps none:
    which chunks stay split depends on the order of a step's calls and on the heap and threshold it
    starts from, not on a row's tensor sizes alone. At the live peak the free chunks are holes of
    the row's own tensor sizes, tens activation-sized and, in the GPT and DistilBERT rows, 2-41
    of the large blocks (planner_slack_replay --holes); Adam's m and v made before the first step
    (planner_slack --eager) move only llama-small's, by 2-5 MiB. What the pipeline engine could do
    (planner_slack --variant): keeping its own blocks (pooled receive buffers, gradients zeroed in
    place) leaves the slack in its spread; trimming the heap after each backward removes a third to a
    half at 10-24 % more CPU a step; only mapping removes it, at 33-73 % more CPU, so no engine here
    does either and the rule counts what a run at the defaults keeps. The rule here is
    calibrated by benchmarks.planner_fit_engine on SLACK_CAL's DDP step (Hardware.alloc_slack)
    and scaled by this stage's model-state bytes over the calibration step's, never above the
    calibrated bytes; the nearest of the two simple rules to benchmarks.planner_local's rows. The
    same slack serves zero_from_scratch's ZeRO-1/2 engine: on SLACK_CAL at micro-batch 2, 4 and 8
    its ZeRO-1 and ZeRO-2 steps kept 41-78 MiB where the DDP step kept 31-81, one run each
    (benchmarks.planner_slack --only gpt-cal --mb N; the fit's ZeRO-1 reading is recorded beside,
    engine_fit). The probes and their numbers, with the load, are in tutorials/15_planner.md
    ("Memory") and RESULTS.md.
    """
    cal = model_state_bytes(0, SLACK_CAL.params(), 2, False)     # its 2 ranks, fp32
    here = states["params"] + states["grads"] + states["optimizer"]
    return hw.alloc_slack * min(1.0, here / sum(cal.values()))
