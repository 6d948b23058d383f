"""The planner's terms fitted on whole steps (benchmarks.planner_fit calls these): the rows' own
measurement (benchmarks.planner_ranks) at a calibration shape, CAL, that no row of
benchmarks.planner_local runs, after the fresh mappings' terms (benchmarks.planner_fit_map).

    python -m benchmarks.planner_fit --engine       # refits step_cpu, zero3_module_s and the mappings (~3 min idle)

    step_cpu        the DDP step's CPU seconds over the planner's sum of its parts at the
                    micro-benchmarks' rates, at the speed planner.probe reads just before (as a
                    row is predicted): what a step costs beyond its parts measured alone, one
                    ratio for every row (what makes it up is not measured: the parts repeat one
                    op or layer on warm caches and a reused heap block; a step's data has left
                    the caches and glibc returns and takes back pages; mmap_s, fitted on a whole
                    step against the same step at glibc's defaults, is charged beside it)
    zero3_module_s  ZeRO-3's CPU seconds beyond ZeRO-1's and beyond what the planner counts for
                    the difference (the fresh mappings the engine's 64 KiB threshold makes,
                    map_layer, map_head and Adam's temporaries at mmap_s; the collective calls) per module fetch or
                    release (3 per module with parameters and step): the engine's hooks, gathers,
                    frees and the pages of parameters and gradients it maps

    slice_cpu       how a rank's CPU seconds per step grow once the ranks outnumber the cores C: the
                    DDP step on C, 2C and 4C ranks, each over the planner's CPU for it (slice_fit;
                    what makes it up is not measured apart: a time-sliced rank finds caches
                    another rank filled); up to 8 cores.
    alloc_slack     the DDP step's peak RSS at glibc's defaults minus the planner's count without
                    slack, the median over SLACK_LAUNCHES fresh interpreters (slack_fit: the slack is
                    drawn at launch, benchmarks.planner_slack_seeds; the ranks of one interpreter
                    share its forkserver's draw); zero1_slack and zero2_slack the same for
                    zero_from_scratch's ZeRO-1 and ZeRO-2 steps, per byte of their largest freed
                    block, and pipe_slack for PIPE_CAL's pipeline (pipe_slack_fit); slack_sigma the
                    spread of ln(slack) over all their launches (planner.host_memory.slack_sigma).
                    None of these is in --engine:
    python -m benchmarks.planner_fit --slices       # only slice_cpu, into the existing file (~1 min idle)
    python -m benchmarks.planner_fit --slack        # only the slacks, into the existing file (~20 min idle)

The --engine terms are each the median of 5 runs of 2 ranks × (DDP, ZeRO-1, ZeRO-3) × 4 steps: a step's CPU moves by up
to a third from one run to the next on a shared virtual machine. The
probe reads the speed of a CPU second before the mappings' fit and before each run, and CPU-second
terms are stored at the fit's speed (× that reading; the planner's at_speed divides by a row's).
"""
from __future__ import annotations

import dataclasses
import os
import statistics

from benchmarks.planner_fit_map import map_fit
from benchmarks.planner_local import LOCAL_SW
from benchmarks.planner_ranks import _rank     # the rows' own measurement, run at another shape
from benchmarks.planner_slack_seeds import MB as SLACK_MB
from benchmarks.planner_slack_seeds import launch
from planner.hardware import at_speed, cpu_here
from planner.host_memory import PIPE_CAL, PIPE_CAL_MICRO, SLACK_CAL, largest_freed, slack_sigma, stage_kinds
from planner.layout import Layout
from planner.memory import memory
from planner.plan import predict_layout
from planner.probe import Probe, read_for
from planner.steptime import zero3_units
from primitives.launch import spawn

CAL = SLACK_CAL     # L 3, h 192, V 12288: the shape planner.host_memory moves the slack from
SLICE_MAX_CORES = 8     # slice_fit runs 4C ranks at once
SLACK_LAUNCHES = 16     # slack_fit's fresh interpreters: each launch's slack is one draw (38-73 MiB for gpt-mini here)


def cpu_alone(lay: Layout, hw) -> float:
    """The planner's CPU seconds of CAL's step: hw without cores (no stretch, no wait); its links'
    α-β kept, since on one host a collective is the ranks' own copies, inside their CPU seconds."""
    t = predict_layout(CAL, CAL.seq, lay, lay.dp * lay.mb, dataclasses.replace(hw, cores=0), LOCAL_SW).time
    return t["total"] - t["bubble"]


def engine_fit(doc: dict, layers, ranks: int, mb: int = 4, steps: int = 4, runs: int = 5) -> dict:
    """{mmap_s, map_layer, map_head, mmap_block_s (map_fit), zero3_module_s, step_cpu}, given
    the rest of the fit (`doc`, cpu_here.json's fields). planner.probe reads the speed of a CPU
    second before each measurement, as before a row, and every CPU-second term is stored at the
    fit's speed (× the reading), as the planner's at_speed divides it again. First the fresh
    mappings (map_fit, at `layers`, `ranks` processes); then benchmarks.planner_local's own
    measurement on the calibration shape CAL, 2 ranks, each the median of `runs` (a step's CPU moves
    by up to a third from one run to the next): the DDP step's CPU seconds over the
    planner's for it at the micro-benchmarks' rates (step_cpu); the CPU seconds ZeRO-3's step
    spends beyond ZeRO-1's and beyond the planner's own difference of the two at that step_cpu
    (the fresh mappings it counts, the collectives), per module fetch or release (its hooks,
    gathers, frees, and the pages it maps that the planner does not count)."""
    slowest = lambda got, key: max(g[key] for g in got)  # noqa: E731  (the rows' step is the slower rank's)
    fits, probe, maps = [], None, {}

    ref = cpu_here(2, fitted=doc)

    def speed_now() -> float:
        probe.samples = []
        probe.within([read_for([probe], 2.0)])
        return probe.rate() / (ref.peak_flops * ref.gemm_efficiency)
    try:
        probe = Probe(os.cpu_count())
        probe.start()
        probe.ready()
        probe.pause()
        speed = speed_now()
        maps = map_fit(layers, ranks)
        maps["mmap_s"] *= speed
        maps["mmap_block_s"] *= speed
        hw = cpu_here(2, fitted={**doc, **{k: v for k, v in maps.items() if k != "mmap_block_s"}, "alloc_slack": 0.0,
                                 "step_cpu": 1.0, "zero3_module_s": 0.0})
        calls = 3 * (zero3_units(CAL, hw) * CAL.layers + 3)
        for _ in range(runs):
            speed = speed_now()
            here = at_speed(hw, speed)
            z0, z1, z3 = (spawn(_rank, 2, args=(CAL, mb, steps, z), timeout=900) for z in (None, 1, 3))
            k = slowest(z0, "cpu") / cpu_alone(Layout(2, 1, 1, mb=mb), here)
            cpu1, cpu3 = (cpu_alone(Layout(2, 1, 1, zero=z, mb=mb), dataclasses.replace(here, step_cpu=k)) for z in (1, 3))
            fits.append((max(0.0, slowest(z3, "cpu") - slowest(z1, "cpu") - (cpu3 - cpu1)) / calls * speed, k))
    finally:
        if probe is not None:
            probe.stop()
    return {**maps, **dict(zip(("zero3_module_s", "step_cpu"), (statistics.median(f[i] for f in fits) for i in range(2))))}


def slack_fit(doc: dict, launches: int = SLACK_LAUNCHES, zero: int = 0) -> tuple[float, list]:
    """(alloc_slack, each launch's): CAL's DDP step, 2 ranks, 4 steps, the rows' own measurement
    (benchmarks.planner_ranks._rank), in `launches` fresh interpreters (benchmarks.planner_slack_seeds
    .launch, as Python starts by default: each its own string-hash seed and address layout, so its
    own draw of the heap a step starts from; spawn's ranks fork from one forkserver per
    interpreter, so runs within one interpreter draw once), each the larger rank's peak less the
    planner's count without slack; the median. `zero` 1 or 2: the same through zero_from_scratch's
    engine at that stage, the median over the step's largest freed block (zero1_slack, zero2_slack:
    bytes per byte, planner.host_memory.allocator_slack)."""
    hw = cpu_here(2, fitted={**doc, "alloc_slack": 0.0, "zero1_slack": 0.0, "zero2_slack": 0.0})
    lay = Layout(2, 1, 1, zero=zero, mb=SLACK_MB)
    pred = memory(CAL, CAL.seq, lay, 2 * SLACK_MB, hw)
    count = pred["total"] - pred["reserved"] - pred["allocator"]
    got = [max(0.0, launch(CAL.name, 4, f"zero{zero}" if zero else "ranks", None) - count) for _ in range(launches)]
    return statistics.median(got) / (largest_freed(CAL, lay, CAL.seq, stage_kinds(lay, pred["stage"])) if zero else 1.0), got


def pipe_slack_fit(doc: dict, launches: int = SLACK_LAUNCHES) -> tuple[float, list]:
    """(pipe_slack, each launch's slack): PIPE_CAL through the pipeline engine (planner_ranks._pp_rank:
    pp 2, mb 2, PIPE_CAL_MICRO micro-batches, 4 steps), in `launches` fresh interpreters as slack_fit's, each the
    larger rank's peak less the planner's count of its heavier stage without slack; the median over
    that stage's largest freed block (planner.host_memory.largest_freed): bytes kept per byte of it."""
    hw = cpu_here(2, fitted={**doc, "alloc_slack": 0.0, "pipe_slack": 0.0})
    lay = Layout(1, 1, 2, mb=2)
    pred = memory(PIPE_CAL, PIPE_CAL.seq, lay, 2 * PIPE_CAL_MICRO, hw)
    count = pred["total"] - pred["reserved"] - pred["allocator"]
    got = [max(0.0, launch(PIPE_CAL.name, 4, "pipe", None) - count) for _ in range(launches)]
    return statistics.median(got) / largest_freed(PIPE_CAL, lay, PIPE_CAL.seq, stage_kinds(lay, pred["stage"])), got


def refit_slack(doc: dict, how: str) -> str:
    """Fit alloc_slack (slack_fit), the ZeRO-1 and ZeRO-2 engine steps' (slack_fit at that stage),
    pipe_slack (pipe_slack_fit) and the launches' spread (planner.host_memory.slack_sigma) into
    `doc`, each launch's slack beside them."""
    k, got = slack_fit(doc)
    (z1, got1), (z2, got2) = (slack_fit(doc, zero=z) for z in (1, 2))
    doc.update(alloc_slack=k, zero1_slack=z1, zero2_slack=z2)
    pipe, piped = pipe_slack_fit(doc)
    doc.update(pipe_slack=pipe, slack_sigma=slack_sigma([got, got1, got2, piped]),
               slack_fit={"command": how, "launches": got, "zero1_launches": got1, "zero2_launches": got2, "pipe_launches": piped})
    span = lambda xs: f"{min(xs) / 2**20:.1f}-{max(xs) / 2**20:.1f}"  # noqa: E731
    return (f"allocator slack {k / 2**20:.1f} MiB, the median of {len(got)} launches ({span(got)}); per byte of the largest "
            f"freed block, the ZeRO-1 engine's step {z1:.2f} ({span(got1)} MiB), ZeRO-2's {z2:.2f} ({span(got2)} MiB), "
            f"a pipeline stage's {pipe:.2f} ({span(piped)} MiB), {len(piped)} launches each; σ of ln(slack) between launches "
            f"{doc['slack_sigma']:.3f}")


def slice_fit(doc: dict, runs: int = 3, mb: int = 4, steps: int = 4) -> tuple[float, list]:
    """(slice_cpu, rows): how much a rank's CPU seconds grow once the ranks outnumber the cores C.
    CAL's DDP step (the rows' own measurement, benchmarks.planner_ranks) on C, 2C and 4C ranks, in
    turn, `runs` times; per run and world the slower rank's CPU seconds per step over the planner's
    for it (cpu_alone: its ring all-reduce grows with the world, which the planner counts already),
    at 2C and 4C over C's (a ratio within a run: the machine's speed moves between runs);
    slice_cpu the least-squares slope of the median ratio − 1 over 1 − C/ranks, through 0
    (planner.cpu_host.slice_factor). Rows: ranks, the median ratio, and each run's."""
    cores = os.cpu_count()
    ns = (cores, 2 * cores, 4 * cores)
    alone = {n: cpu_alone(Layout(n, 1, 1, mb=mb), cpu_here(n, fitted=doc)) for n in ns}
    cpu = {n: [] for n in ns}
    for _ in range(runs):
        for n in ns:
            cpu[n].append(max(g["cpu"] for g in spawn(_rank, n, args=(CAL, mb, steps, None), timeout=900)) / alone[n])
    ratios = {n: [c / b for c, b in zip(cpu[n], cpu[cores])] for n in ns[1:]}
    rows = [{"ranks": n, "ratio": statistics.median(r), "runs": r} for n, r in ratios.items()]
    xs, ys = [1 - cores / r["ranks"] for r in rows], [r["ratio"] - 1 for r in rows]
    return max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)), rows


def map_line(maps: dict) -> str:
    """The fresh mappings' terms, as the fit prints them."""
    return (f"a mapped page {maps['mmap_s'] * 2**20 * 1e3:.2f} ms CPU per MiB, {maps['map_layer']:.2f} bytes mapped per "
            f"saved layer byte, {maps['map_head']:.2f} per logit byte")


def refit_engine(doc: dict, layers, ranks: int, how: str) -> str:
    """Fit the mappings and the whole-step terms (engine_fit) into `doc`; a 1 MiB block's page cost
    alone is printed beside the step's, not kept."""
    eng = engine_fit(doc, layers, ranks)
    block = eng.pop("mmap_block_s")
    doc.update(eng, engine_fit=how)
    return (f"{map_line(doc)} (a 1 MiB block alone {block * 2**20 * 1e3:.2f} ms per MiB); ZeRO-3 {doc['zero3_module_s'] * 1e3:.2f} ms CPU per module fetch/release; a step's CPU "
            f"{doc['step_cpu']:.2f}× its parts at the micro-benchmarks' rates")


def refit_slices(doc: dict, how: str) -> str:
    """Fit slice_cpu (slice_fit) into `doc`, its rows beside it; on more than SLICE_MAX_CORES cores
    (4C ranks at once) it is not fitted and stays 0 (no term), the record saying so."""
    if (cores := os.cpu_count()) > SLICE_MAX_CORES:
        doc.update(slice_cpu=0.0, slice_fit={"command": how, "rows": [], "skipped": f"{cores} cores: 4C ranks too many"})
        return f"slice_cpu not fitted on {cores} cores (4C = {4 * cores} ranks at once): 0, no term"
    k, rows = slice_fit(doc)
    doc.update(slice_cpu=k, slice_fit={"command": how, "rows": rows})
    grows = " and ".join(f"×{r['ratio']:.2f} at {r['ranks']} ranks" for r in rows)
    return f"a rank's CPU per step over the planner's {grows} of {cores}'s: slice_cpu {k:.3f}"
