"""What a CPU host's rank keeps resident beyond the tensors planner.memory counts (cpu-here):
the runtime's pages per layer family and glibc's slack.

    python -m benchmarks.planner_mem_probe      # the runtime's pages, llama's slack → planner/cpus/PROCESSOR/cpu_mem.json
    python -m benchmarks.planner_mem            # a measured peak split into its parts

Cost: one JSON read, cached.
"""
from __future__ import annotations

import functools
import json
import math
import os
import statistics

from planner.hosts import check_cpu, fitted_path
from planner.layout import Layout
from planner.model import Model

CPU_MEM = fitted_path("cpu_mem.json")     # this processor's (benchmarks.planner_mem_probe), else the shipped one
SLACK_CAL = Model("gpt-cal", 3, 192, 4, 12288, 128, positions=128)   # benchmarks.planner_fit_engine's calibration shape (CAL)
GLIBC_MMAP_MAX = 32 << 20     # glibc's dynamic mmap threshold stops rising here (64-bit): larger blocks are always mapped


def family(model) -> str:
    """The layer family a CPU host runs (torch_layer_activation_bytes's dispatch): torch, distilbert, llama."""
    return "llama" if model.gated else (model.family or "torch")


@functools.lru_cache(maxsize=None)
def _cpu_mem() -> dict:
    if not os.path.exists(CPU_MEM):
        return {}
    with open(CPU_MEM) as f:
        got = json.load(f)
    check_cpu(CPU_MEM, got.get("cpu"))
    return got


SLACK_BLOCKS = ("activations", "logit_grads", "ends")    # the blocks a llama stage's slack is fitted on


def llama_slack(model) -> dict | None:
    """{block: bytes of slack per byte of it} of the model's layer family where probed
    (benchmarks.planner_mem_probe: llama's); None where its slack follows the model states."""
    got = _cpu_mem().get("slack", {}).get(family(model))
    if got is None:
        return None
    if missing := [k for k in SLACK_BLOCKS if k not in got]:
        raise ValueError(f"{CPU_MEM}: {family(model)}'s slack lacks {missing}: rerun python -m benchmarks.planner_mem_probe")
    return {k: float(got[k]) for k in SLACK_BLOCKS}


def runtime_bytes(model, lay=None) -> float:
    """Resident bytes a rank's first steps add beyond its tensors, a property of this machine's torch
    build per layer family (benchmarks.planner_mem_probe, one process at a probe shape): the code
    pages of the kernels the family touches after the warm-up (RssFile) and the anonymous memory
    the runtime keeps beside the tensors (small-block heap, the autograd graph, oneDNN/MKL
    buffers); at ZeRO ≥ 1 also what zero_from_scratch's engine adds to the same step (the probe's
    "zero": the modules initialize imports, its units, hooks and ledgers). 0 when not probed."""
    runtime = _cpu_mem().get("runtime", {})
    got, engine = runtime.get(family(model)), runtime.get("zero") if lay is not None and lay.zero >= 1 else None
    # the engine's is a difference of two probes (measured at ZeRO-1, the same code at 2 and 3): never below 0
    return (float(got["file"] + got["anon"]) if got else 0.0) + (max(0.0, float(engine["file"] + engine["anon"])) if engine else 0.0)


def largest_freed(model, lay, seq: int, blocks: dict) -> float:
    """The largest single block a stage's step frees that glibc may keep in its heap (below
    GLIBC_MMAP_MAX), of the kinds the stage has: a layer's widest activation (b·s·f/t), the loss's
    logits (b·s·V/t, the last stage), an end matrix (V·h/t: the embedding's or the head's weight,
    its gradient, Adam's temporaries of its size); 0 when none is below."""
    b, t = seq * lay.mb, lay.tp
    one = [4 * b * model.f / t if blocks.get("activations") else 0.0,
           4 * b * model.vocab / t if blocks.get("logit_grads") else 0.0,
           4 * model.vocab * model.hidden / t if blocks.get("ends") else 0.0]
    return max((x for x in one if x < GLIBC_MMAP_MAX), default=0.0)


def stage_kinds(lay, stage: str) -> dict:
    """The kinds of block a stage frees (largest_freed's `blocks`, as flags): the logits only where the loss runs."""
    return {"activations": 1.0, "logit_grads": 1.0 if stage == "last" or lay.pp == 1 else 0.0, "ends": 1.0}


SLACK_CAL_MB = 4        # SLACK_CAL's micro-batch in its DDP step (benchmarks.planner_fit_engine.slack_fit)
CAL_BLOCKS = {"activations": 1.0, "logit_grads": 1.0, "ends": 1.0}       # that step's kinds: all of them
CAL_S = largest_freed(SLACK_CAL, Layout(2, 1, 1, mb=SLACK_CAL_MB), SLACK_CAL.seq, CAL_BLOCKS)   # its S, once
# the DDP step's slack per byte of S between two shapes no row runs: the calibration step's (alloc_slack, 72.6
# MiB over 16 launches at S 24 MiB) and benchmarks.planner_slack_across's V 4,096 (41.1 MiB at S 8 MiB), RESULTS.md
SLACK_SLOPE = 2.0
PIPE_CAL = Model("gpt-pcal", 4, 256, 4, 16000, 128, positions=128)    # pipe_slack's shape: pp 2, mb 2,
PIPE_CAL_MICRO = 4                                                     # and its micro-batches a step


FIT_RANKS = {"ddp": 2, "zero": 2, "pipe": 1, "llama": 1}    # ranks of the fitted stage each rule's launch takes its peak over


def slack_sigma(launches: list[list[float]]) -> float:
    """σ of ln(slack) from launch to launch, pooled over the fits' sets of launches, each about its
    own mean (16 launches a set tell the rules' levels apart better than their spreads)."""
    logs = [[math.log(x) for x in xs if x > 0] for xs in launches]
    logs = [xs for xs in logs if len(xs) > 1]
    return math.sqrt(statistics.fmean(statistics.variance(xs) for xs in logs)) if logs else 0.0


def worst_of(ranks: int, fit_ranks: int, sigma: float) -> float:
    """The median of the largest of `ranks` draws of a stage's slack over the median of the largest
    of `fit_ranks` (what its fit measured): a layout's peak per GPU is its fullest rank's, and the
    ranks of one stage end their steps with heaps as far apart as launches do (benchmarks.planner_local
    --runs prints the spread between the ranks of one stage within a run). With ln(slack) normal of
    spread σ, the largest of k draws is below x with probability F(x)^k, so its median is one draw's
    0.5^(1/k) quantile. Below the fit's ranks it is under 1: one rank's median is below the larger of two's."""
    if sigma <= 0 or ranks == fit_ranks:
        return 1.0
    z = statistics.NormalDist().inv_cdf
    return math.exp(sigma * (z(0.5 ** (1 / ranks)) - z(0.5 ** (1 / fit_ranks))))


def allocator_slack(model, lay, seq: int, blocks: dict, hw, micro: int = 4) -> float:
    """Bytes glibc keeps resident beyond the live tensors at its defaults: free chunks below the
    heap's highest point in a step (benchmarks.planner_slack_replay). Torch asks for every tensor
    with posix_memalign (64 bytes); glibc's memalign takes size + alignment + MINSIZE from its bins
    and splits the chunk it gets, so a freed tensor's chunk serves the next request of its own size
    only once merged with a free neighbour, and the runtime's small blocks, carved from the
    fragments, keep neighbours apart: the step's heap top rises above its live peak. Which chunks
    stay split depends on the order of a step's calls and the heap it starts from
    (planner_slack_replay: the same calls unaligned keep 8-43 % of it, with the mmap threshold
    raised first llama-small's keep none), and that heap is set at launch (planner_slack_seeds:
    one process with PYTHONHASHSEED and its address layout fixed keeps the same slack twice; as
    Python starts it, gpt-mini's 4-step slack is 38-73 MiB from launch to launch), so the rule is
    measured per layer family and engine and is at best the slack's middle:
      torch's layer (and DistilBERT's, not fitted apart), one micro-batch a step (DDP, tp; ZeRO-1/2 without their fit):
        hw.alloc_slack, fitted on SLACK_CAL's DDP step by benchmarks.planner_fit_engine, moved by
        SLACK_SLOPE bytes per byte of the difference of S, the largest of the blocks the planner
        tracks (a layer's widest activation, the logits, an end matrix) below glibc's mmap ceiling
        (largest_freed; DDP's flat gradient copy is not among them), from the calibration step's; a
        stage whose blocks are all mapped (S = 0) keeps alloc_slack − SLACK_SLOPE·S_cal, never
        below 0, no row here tests that: an empirical line, not glibc's mechanism (with glibc's
        thresholds fixed at their ceiling llama-small keeps the same slack, planner_slack --risen:
        not how far S raises them), its slope from the DDP step at two shapes no row runs (the
        calibration shape, S 24 MiB, and planner_slack_across's V 4,096, S 8 MiB); at V 16,000,
        micro-batch 2 (the embedding as large as the logits) planner_slack_across finds 14 MiB more.
      zero_from_scratch's ZeRO-1 or ZeRO-2 step (pp 1; with or without offload, not fitted
        apart): hw.zero1_slack / zero2_slack bytes per byte of S, each fitted on that engine's step
        at SLACK_CAL as alloc_slack is (benchmarks.planner_fit --slack); the engine keeps more than
        torch's step there and about as much at a small S; proportional, as the pipeline's, a form,
        not derived: planner_slack_across finds it 6-14 MiB under at V 4,096 and 46-47 under at V
        16,000, micro-batch 2. Without the fit, the rule above.
      a pipeline stage of that layer (pp > 1): hw.pipe_slack bytes per byte of S, fitted on
        PIPE_CAL's pipeline at PIPE_CAL_MICRO micro-batches a step (benchmarks.planner_fit_engine
        .pipe_slack_fit), times the square root of the step's `micro` over that: a stage runs its
        micro-batches' forwards and backwards between its sends and receives and keeps more than
        the one-micro-batch step at the same S, more with more micro-batches (the square root
        chosen on planner_slack_across's 2, 4 and 8 micro-batches, which are its only check).
        Without the fit, the rule above.
      Hugging Face's llama layer: the slack grows with the micro-batch at fixed model states and
        with the vocabulary at fixed activations: some of the blocks of each size a step frees stay
        as holes. So it is a sum over the stage's blocks (`blocks`, bytes): its activations, the
        loss's logit gradients (the last stage) and its end matrices (embedding, head), each times
        a factor fitted by least squares on both stages of a shape no row uses, vocabulary 1,024
        and 8,192, micro-batch 2, 4 and 8, 4 micro-batches a step (benchmarks.planner_mem_probe);
        that shape at vocabulary 4,096 and llama-small's rows are the check (planner_mem_probe
        --vocab 4096, planner_slack --mb N). A kind whose one block (b·s·h, b·s·V/t, V·h/t in fp32)
        reaches GLIBC_MMAP_MAX is always mapped and leaves no hole, so it adds nothing: a 7 B
        llama's stages keep none.
    Each rule is fitted on what its fit measured, the fullest of FIT_RANKS ranks of one stage (the
    median over launches; llama's, a least-squares line over the probe's shapes).
    A layout whose stages are held by lay.dp·lay.tp ranks each is measured at its fullest rank, so the
    rule is moved to the median of the largest of that many draws (worst_of, hw.slack_sigma: the
    spread of the fits' launches, benchmarks.planner_fit --slack).
    What an engine could do about it (planner_slack --variant): keeping its own blocks leaves the
    slack; trimming the heap after each backward removes a third to a half at 10-24 % more CPU a
    step; only mapping removes it, at 33-73 % more, so none does and the rule counts what a run at
    the defaults keeps. The probes and their numbers: tutorials/15_planner.md ("Memory"), RESULTS.md.
    """
    worst = functools.partial(worst_of, lay.dp * lay.tp, sigma=hw.slack_sigma)
    fitted = llama_slack(model)
    if fitted is not None:
        b, h, V, t = seq * lay.mb, model.hidden, model.vocab, lay.tp
        one = {"activations": 4 * b * h, "logit_grads": 4 * b * V / t, "ends": 4 * V * h / t}    # one block of each kind
        return sum(fitted[k] * blocks[k] for k in SLACK_BLOCKS if one[k] < GLIBC_MMAP_MAX) * worst(FIT_RANKS["llama"])
    if not hw.alloc_slack:         # no fitted slack (a GPU's file, or a fit counting without it): no term
        return 0.0
    big = largest_freed(model, lay, seq, blocks)
    if lay.pp > 1 and hw.pipe_slack:
        return hw.pipe_slack * big * (micro / PIPE_CAL_MICRO) ** 0.5 * worst(FIT_RANKS["pipe"])
    if lay.pp == 1 and (per_byte := {1: hw.zero1_slack, 2: hw.zero2_slack}.get(lay.zero, 0.0)):
        return per_byte * big * worst(FIT_RANKS["zero"])
    return max(0.0, hw.alloc_slack + SLACK_SLOPE * (big - CAL_S)) * worst(FIT_RANKS["ddp"])
