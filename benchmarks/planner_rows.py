"""The rows benchmarks.planner_local runs and how each is predicted, and its recorded runs predicted
again by this checkout, nothing run (one run, or several with memory at their median).

    python -m benchmarks.planner_local --repredict rows.json            # one run's rows predicted again
    python -m benchmarks.planner_local --runs a.json b.json c.json      # several runs, memory at their median

A row is (model, layout label, Layout, global batch, rank function, its args); planner_local's
docstring says what each runs and how it is measured.
Cost: one prediction per row (milliseconds).
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import random
import statistics
from dataclasses import replace

from rich.table import Table

from benchmarks.planner_nodes import on_two_nodes, two_nodes_possible
from benchmarks.planner_ranks import SHAPES, _llama_pp_rank, _pp_rank, _rank, llama_planner_model
from benchmarks.planner_ranks_tp import _tp_pp_rank, _tp_rank, distilbert_planner_model
from planner import hardware as H
from planner.hosts import fitted_on
from planner.layout import Layout
from planner.plan import predict_layout
from planner.steptime import Software
from primitives.log import console

TUNED = "(malloc 64K)"
LOCAL_SW = Software(overlap_dp=False, overlap_tp=False, overlap_pp=False, flash_attention=False, balanced_stages=False)


def runs(quick: bool, steps: int, mb: int = 4):
    """(model, layout label, Layout, global batch, rank function, its args) of every row."""
    small, mid = SHAPES
    out = [(small, f"dp2 Z0 (torch) mb{mb}", Layout(2, 1, 1, mb=mb), 2 * mb, _rank, (small, mb, steps, None))]
    if quick:
        return out
    out.append((mid, f"dp2 Z0 (torch) mb{mb}", Layout(2, 1, 1, mb=mb), 2 * mb, _rank, (mid, mb, steps, None)))
    out += [(small, f"dp2 Z{z} (engine) mb{mb}", Layout(2, 1, 1, zero=z, mb=mb), 2 * mb, _rank, (small, mb, steps, z))
            for z in (1, 2, 3)]
    out.append((small, f"dp2 Z1+off (engine) mb{mb}", Layout(2, 1, 1, zero=1, offload=True, mb=mb), 2 * mb, _rank,
                (small, mb, steps, 1, False, True)))
    out.append((small, "pp2 1F1B m4 mb2 (engine)", Layout(1, 1, 2, mb=2), 8, _pp_rank, (small, 2, 4, steps)))
    out.append((small, "pp2·dp2 1F1B m4 mb2 (engine)", Layout(2, 1, 2, mb=2), 16, _pp_rank, (small, 2, 4, steps)))
    distil = distilbert_planner_model("distil-mini", 4, 256, 4, 8192, 128)
    out += [(distil, f"{'dp2·' if dp > 1 else ''}tp2 mb{mb} (parallelize, HF DistilBERT)", Layout(dp, 2, 1, mb=mb), dp * mb,
             _tp_rank, (distil, 2, mb, steps)) for dp in (1, 2)]
    untied = replace(distil, name="distil-mini (untied)", tied=False)   # the last stage's own output layer, as built
    out += [(untied, f"{'dp2·' if dp > 1 else ''}pp2·tp2 1F1B m4 mb2 (engine + parallelize, HF DistilBERT)",
             Layout(dp, 2, 2, mb=2), 8 * dp, _tp_pp_rank, (untied, 2, 2, 4, steps)) for dp in (1, 2)]
    for preset in ("tiny", "small"):     # pipeline_parallel/models/llama.py's presets, HF's decoder layer
        lm = llama_planner_model(preset, 128)
        out.append((lm, "pp2 1F1B m4 mb2 (engine, HF llama)", Layout(1, 1, 2, mb=2), 8, _llama_pp_rank,
                    (preset, 128, 2, 4, steps)))
    out.append((small, f"dp2 Z0 (torch) mb{mb} {TUNED}", Layout(2, 1, 1, mb=mb), 2 * mb, _rank,
                (small, mb, steps, None, True)))
    if not two_nodes_possible():
        out.append((small, f"2 nodes × 1: dp2 Z0 (torch) mb{mb}", Layout(2, 1, 1, mb=mb), 2 * mb, on_two_nodes, (0, mb, steps)))
    return out


def row_speed(before: float, after: float | None) -> float:
    """The speed of a CPU second over a row from the probe alone: the harmonic mean of the readings
    before and after it (the reading before alone where none was taken after)."""
    return before if not after else 2.0 / (1.0 / before + 1.0 / after)


def in_row_speed(got: list[dict], fitted_rate: float, mean=statistics.harmonic_mean) -> float | None:
    """The speed over a row as its ranks read it (planner_ranks._timed): the harmonic mean (a step's
    CPU seconds go as 1 / speed), or `mean`, of every rank's readings from the one before the second
    step (the first the median counts) to the one after the last, over the fit's rate; None where
    the ranks read none."""
    rates = [x for g in got for x in (g.get("rates") or [])[1:]]
    return mean(rates) / fitted_rate if rates else None


def least_worst(measured: list[float]) -> float:
    """The smallest worst-run |error| any one predicted figure can have against these measurements:
    2·lo·hi / (lo + hi) is as far below the highest as above the lowest, (hi − lo) / (hi + lo) from each."""
    lo, hi = min(measured), max(measured)
    return (hi - lo) / (hi + lo)


def predicted(m, label, lay, batch, nodes: bool, load: float, wake: float, speed: float):
    """(hw, sw, prediction) of one row from the probe's reading: the load (other runnable tasks),
    the woken share, the speed of a CPU second over the fit's."""
    hw = H.at_speed(replace(H.cpu_here(lay.gpus), load=load, wake_share=wake), speed)
    hw = replace(hw, gpus_per_node=1) if nodes else hw
    sw = replace(LOCAL_SW, mapped_alloc=label.endswith(TUNED))   # the tuned row maps every large block
    return hw, sw, predict_layout(m, m.seq, lay, batch, hw, sw)


def _read_rows(path: str) -> list[dict]:
    """A --json file's rows, refused unless measured on this processor with its fit's rate recorded."""
    with open(path) as f:
        rows = json.load(f)
    here = fitted_on(H.CPU_HERE)
    if other := sorted({str(r.get("cpu")) for r in rows if r.get("cpu") != here or "rate" not in r.get("fit", {})}):
        raise SystemExit(f"{path}: rows measured on {', '.join(other)} (None: rows that do not name it and their "
                         f"fit's rate; rerun them), the fit read here ({H.CPU_HERE}) is {here}'s: a processor's measurements "
                         "are predicted with its own fit")
    return rows


@functools.lru_cache(maxsize=1)
def _spec() -> dict:
    """{"model layout": (model, label, Layout, batch, rank function)} of every row, built once."""
    return {f"{m.name} {label}": (m, label, lay, batch, fn) for m, label, lay, batch, fn, _ in runs(False, 4)}


def _again(r: dict) -> tuple[float, float]:
    """(step, memory) of a recorded row predicted by this checkout at the readings the run recorded
    (the load and woken share before it; the speed: in_row_speed of the ranks' readings, else the
    speed the run predicted at, else the probe's)."""
    m, label, lay, batch, fn = _spec()[f"{r['model']} {r['layout']}"]
    rate = (hw := H.cpu_here()).peak_flops * hw.gemm_efficiency      # a speed is over a fit's rate
    ranks = in_row_speed([{"rates": x} for x in r.get("rates") or []], rate)     # FLOPs per CPU second over this fit's
    speed = ranks or (r.get("row_speed") or row_speed(r["speed"], r.get("after", {}).get("speed"))) * r["fit"]["rate"] / rate
    p = predicted(m, label, lay, batch, fn is on_two_nodes, r["load"], r["wake"], speed)[2]
    return p.time["total"], p.memory["total"] - p.memory["reserved"]


def repredict(path: str) -> None:
    """Each row of a --json file predicted again by this checkout's planner and its processor's fit
    (_again), beside the run's own error; the measurements are the run's."""
    t = Table(title=f"{path}: error then → now, %")
    for c in ("row", "load", "step", "memory"):
        t.add_column(c, justify="right")
    now = []
    for r in _read_rows(path):
        step, mem = _again(r)
        now.append((step / r["step_meas"] - 1, mem / r["mem_meas"] - 1))
        t.add_row(f"{r['model']} {r['layout']}", f"{r['load']:.1f}", f"{r['step_pred'] / r['step_meas'] - 1:+.0%} → {now[-1][0]:+.0%}",
                  f"{r['mem_pred'] / r['mem_meas'] - 1:+.0%} → {now[-1][1]:+.0%}")
    console.print(t)
    console.print(f"median |error| now: step time {statistics.median(abs(x) for x, _ in now):.0%}, "
                  f"memory {statistics.median(abs(y) for _, y in now):.0%}")


def held_sets(got: dict, runs: int, k: int, most: int = 2000) -> tuple[int, int]:
    """(sets that hold, sets tried): of the sets of k of the runs (all, or a seeded sample of `most`),
    those in which every row's median step error is within 25 % and its predicted peak within 10 %
    of its measured peaks' median: how many runs a judgement at the median needs."""
    every = list(itertools.combinations(range(1, runs + 1), k))
    sets = every if len(every) <= most else random.Random(0).sample(every, most)

    def holds(chosen) -> bool:
        for rs in got.values():
            rs = [x for x in rs if x[3] in chosen]
            if rs and (abs(statistics.median(s / r["step_meas"] - 1 for r, s, _, _ in rs)) > 0.25
                       or abs(rs[0][2] / statistics.median(r["mem_meas"] for r, *_ in rs) - 1) > 0.10):
                return False
        return True
    return sum(holds(set(c)) for c in sets), len(sets)


def rank_spread(got: dict) -> dict[str, float]:
    """{row: σ of ln(slack) between the ranks of its fullest stage within one run, pooled over the
    runs} for the rows whose stage is held by several ranks with a slack term (tp 1, dp ≥ 2, not
    mapped): slack is each rank's peak less the planner's count without it. How far apart one run's
    ranks end, against planner.host_memory.worst_of's σ, fitted from launch to launch."""
    out = {}
    for key, rs in got.items():
        m, label, lay, batch, fn = _spec()[key]
        if lay.tp > 1 or lay.dp < 2:
            continue
        r = rs[0][0]
        mem = predicted(m, label, lay, batch, fn is on_two_nodes, r["load"], r["wake"], 1.0)[2].memory
        count = mem["total"] - mem["reserved"] - mem["allocator"]
        if not mem["allocator"]:
            continue
        stage = range((lay.pp - 1) * lay.dp, lay.pp * lay.dp)      # the last stage's ranks (pipe-major ranks)
        logs = [[math.log(x[i] - count) for i in stage] for x in (r["mem_per_rank"] for r, *_ in rs if r.get("mem_per_rank"))
                if all(x[i] > count for i in stage)]
        if logs:
            out[key] = math.sqrt(statistics.fmean(statistics.variance(v) for v in logs))
    return out


def over_runs(paths: list[str]) -> None:
    """Rows of several --json files (runs, numbered in the order given) predicted by this checkout (_again): each run's errors, and
    memory against the median of the runs' measurements, since a run's rows fork from one
    interpreter and share its draw of the allocator's heap (benchmarks.planner_slack_seeds); the
    rows no single figure meets in every run (least_worst), how many sets of 1, 3, 5 runs hold
    every row at their medians (held_sets), and how far apart one run's ranks of a stage end (rank_spread)."""
    got: dict[str, list] = {}
    for i, path in enumerate(paths):
        for r in _read_rows(path):
            got.setdefault(f"{r['model']} {r['layout']}", []).append((r, *_again(r), i + 1))
    t = Table(title=f"{len(paths)} runs predicted by this checkout: error %, each run, and memory at the runs' median")
    for c in ("row", "runs", "step, each run", "memory, each run", "MiB predicted", "measured median (range)", "error "):
        t.add_column(c, justify="right")
    misses, on_median, spread = [], [], []
    for key, rs in got.items():
        step = [s / r["step_meas"] - 1 for r, s, _, _ in rs]
        mem = [m / r["mem_meas"] - 1 for r, _, m, _ in rs]
        meas = [r["mem_meas"] for r, _, _, _ in rs]
        med = rs[0][2] / statistics.median(meas) - 1
        misses += [f"{key} (run {run}: {' and '.join(w for w, bad in (('step', abs(a) > 0.25), ('memory', abs(b) > 0.10)) if bad)})"
                   for (_, _, _, run), a, b in zip(rs, step, mem) if abs(a) > 0.25 or abs(b) > 0.10]
        on_median += [key] if abs(med) > 0.10 else []
        if (least := least_worst(meas)) > 0.10:
            spread.append(f"{key} ({min(meas) / 2**20:.1f}-{max(meas) / 2**20:.1f} MiB: ±{least:.1%})")
        t.add_row(key, str(len(rs)), " ".join(f"{x:+.0%}" for x in step), " ".join(f"{x:+.1%}" for x in mem),
                  f"{rs[0][2] / 2**20:.1f}", f"{statistics.median(meas) / 2**20:.1f} ({min(meas) / 2**20:.1f}-{max(meas) / 2**20:.1f})",
                  f"{med:+.1%}")
    console.print(t)
    held = ", ".join(f"{k}: {a:,} of {n:,}{' (a sample)' if n < math.comb(len(paths), k) else ''}"
                     for k in (1, 3, 5) if k <= len(paths) for a, n in [held_sets(got, len(paths), k)])
    console.print(f"sets of k runs whose medians hold every row (step ≤ 25 %, memory ≤ 10 %): {held}", highlight=False)
    apart = ", ".join(f"{k} {v:.3f}" for k, v in rank_spread(got).items())
    console.print(f"σ of ln(slack) between the ranks of one stage within a run (the fit's, from launch to launch: "
                  f"{H.cpu_here().slack_sigma:.3f}): {apart or 'no row with several ranks a stage'}", highlight=False)
    console.print(f"misses in a run (step > 25 %, memory > 10 %): {'; '.join(misses) or 'none'}\n"
                  f"memory beyond 10 % of the runs' median: {', '.join(on_median) or 'none'}\n"
                  f"rows whose measured peak no single figure meets within 10 % in every run (least_worst): "
                  f"{'; '.join(spread) or 'none'}", highlight=False)
