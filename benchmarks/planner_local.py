"""The planner against this machine: small GPT-shaped models on 2-4 CPU ranks, predicted
(hardware cpu-here) vs measured step time and peak memory per rank, at the allocator's defaults.

    python -m benchmarks.planner_local               # every row below, 4 steps each (~6 min idle)
    python -m benchmarks.planner_local --quick       # one shape DDP, 3 steps (unless --steps)
    python -m benchmarks.planner_local --only pp2 --json rows.json      # some rows; the rows as JSON
    python -m benchmarks.planner_local --repredict rows.json            # those rows predicted again, nothing run
    python -m benchmarks.planner_local --runs a.json b.json c.json      # several runs predicted again, memory at their median

Each shape is planner.model.Model built in torch (token + position embeddings, pre-norm
nn.TransformerEncoderLayer × L, a tied output layer: the planner's parameter count exactly), fp32,
AdamW. Rows (the label says which engine runs it):
    dp2 Z0 (torch)        one flat gradient all-reduce after backward through ringzero's default path
    dp2 Z1/Z2/Z3 (engine) zero_from_scratch's DeepSpeed-API engine, overlap_comm off
    dp2 Z1+off (engine)   the same with offload_optimizer device cpu (the host is the device here:
                          the fp32 master and Adam's m, v stay in the rank's memory, counted)
    pp2 / pp2·dp2         pipeline_parallel's engine, 1F1B, 4 micro-batches, L/2 layers per stage
                          (4 ranks on the 2 cores for pp2·dp2)
    tp2 / dp2·tp2         Hugging Face's DistilBERT (eager attention) with a head tied to its word
                          embedding, split by tensor_parallel.parallelize (Megatron's layer split, the
                          vocabulary over the embedding, head and loss), dp's gradients in one flat
                          all-reduce (4 ranks for dp2·tp2)
    pp2 (HF llama)        pipeline_parallel/models/llama.py's presets tiny and small (HF's
                          LlamaDecoderLayer, SDPA) through the pipeline engine, as pp2 above
    ... (malloc 64K)      the DDP row again with glibc's mmap threshold fixed at 64 KiB (mallopt),
                          a tuned allocator beside the default one, labelled
    2 nodes × 1           the DDP row with one rank on each of two nodes of multinode/'s cluster on
                          this machine (network namespaces, a 400 Mbit/s tbf-shaped veth between
                          them; needs root and iproute2, else the row is left out)
    pp2·tp2 / dp2·pp2·tp2 3D: the DistilBERT blocks, parallelize'd, on pipeline_parallel's stages
                          over one mesh (4 and 8 ranks; the last stage's own output layer: untied)

What calibrates what: the rates (GEMM, the layer's and the logits' non-matmul work, the vocab-parallel loss's, Adam, one
collective call's CPU) are CPU seconds fitted by `python -m benchmarks.planner_fit` on
micro-benchmarks at other shapes (planner/cpus/PROCESSOR/cpu_here.json, planner.hosts); the links are the α-β that
benchmarks.one_host fitted (primitives.engine.cost.FITTED); the pages a step maps afresh and
a page's cost from page faults and the calibration step mapped and not (benchmarks.planner_fit_map); the
allocator's slack, the ZeRO-3 module cost and step_cpu (a step's CPU over its parts: one ratio,
planner.hardware.per_step) from this benchmark's own DDP / ZeRO steps at a calibration shape
(benchmarks.planner_fit_engine: the DDP rows run the same code at other shapes); the wait a
blocking collective pays for a descheduled peer once ranks outnumber the cores (wait_s) from a ping-pong of 2-8 busy processes (`python -m benchmarks.planner_fit --waits`), and what a rank's CPU seconds grow by then (slice_cpu) from the DDP step at the calibration shape on C, 2C, 4C ranks (`--slices`).
No row's timing feeds any constant. Three inputs are read by planner.probe for PROBE_S seconds
just before each row, and a first prediction is made from them before the ranks start: as many
busy processes as cores repeating the fit's matmuls give the share of a core a busy task gets, so
the other runnable tasks (→ the load: cpu_stretch and pipeline_stretch turn CPU seconds into wall
seconds with it), and the FLOPs a CPU second buys now (→ the speed: every fitted CPU-second rate
scaled by it over the fit's, planner.hardware.at_speed); beside them planner.probe.Sleeper, which
works and sleeps in turn, the share a woken task gets (→ hw.wake_share: ranks that wait inside a
step run at it). The probe is paused (SIGSTOP) while the ranks run, so they run beside the
machine's other work only, as a user's run would; it reads again for PROBE_AFTER_S after the row
(the JSON's "after"). This guest's speed moves by up to 1.8× within minutes, so the ranks read it
too: the probe's products for 0.2 CPU seconds before each step and after the last, outside the
timed step (planner.probe.Rate, planner_ranks._timed: long enough that a dip of the guest's
speed for a twentieth of a second, which often strikes both ranks' readings at once, counts for
its length as it does in a step). The row reports its median step (median_step) and predicts it
at the harmonic mean of every rank's readings from the one before the second step to the one
after the last (planner_rows.in_row_speed: a step's CPU seconds go as 1 / speed). Beside it: the
prediction at their median ("median reading": the guest's dips are short, a step beside one runs
up to half again as long, so a median step is one they spared; when they strike most of a row's
readings neither the harmonic mean nor the median sees the steps between them), at the probe's
readings before and after ("probe before/after") and from the reading before alone ("before
only"), which is what a plan made ahead gets.
The benchmark runs itself as a session of its own, as a run from its own terminal would.
Time: of the steps after the first, the one whose slower rank's time is the median (the lower of
two); that step's CPU seconds (thread_time, the larger rank's) beside.
The tuned row and ZeRO-3 (whose engine fixes the same threshold) map every large block: the
planner counts no allocator slack there and mmap_s per byte each step maps afresh (map_layer per
saved layer byte, map_head per logit byte).
Memory: the peak resident set (VmHWM, clear_refs reset) minus the RSS just before the model is
built, per rank, the larger rank reported. Before the baseline a tiny model runs one step with
AdamW and one all-reduce and the rank's Rate makes its outputs and runs once (its GEMM kernels'
pages), so torch's lazily loaded modules and pools are in the baseline, not in the measurement (that is the planner's `reserved`, left out of both sides). At glibc's default
the mmap threshold rises to the largest block freed (up to 32 MiB), so later blocks below it
come from the heap and freed memory can stay resident: the measured peak includes that, as a
user's would.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace

from rich.table import Table

from benchmarks.planner_nodes import on_two_nodes, two_nodes_possible
from benchmarks.planner_rows import LOCAL_SW, TUNED, in_row_speed, over_runs, predicted, repredict, row_speed, runs  # noqa: F401 (LOCAL_SW, TUNED: the rows' names, read from here)
from planner import hardware as H
from planner.hosts import fitted_on, this_cpu
from planner.plan import predict_layout
from planner.probe import Probe, Sleeper, in_own_session, read_for
from planner.cpu_host import cpu_stretch
from primitives.engine.cost import Params
from primitives.launch import spawn
from primitives.log import console
from zero_from_scratch.engine.atomic import atomic_write

PROBE_S, PROBE_AFTER_S = 2.0, 1.0      # seconds the probe reads the machine before a row and after it


def measure(quick: bool, steps: int, only: str = "") -> list[dict]:
    rows = []
    probe, sleeper = Probe(os.cpu_count()), Sleeper()    # as many busy processes as cores; a woken task
    for p in (probe, sleeper):
        p.start()
    for p in (probe, sleeper):
        p.ready()
        p.pause()
    try:
        for m, label, lay, batch, fn, args in runs(quick, steps):
            if only in label:
                rows.append(_row(m, label, lay, batch, fn, args, probe, sleeper))
    finally:
        probe.stop()
        sleeper.stop()
    return rows


def median_step(got: list[dict]) -> tuple[int, float] | None:
    """(index, seconds) of the step a row reports: of the steps after the first, the one whose slower
    rank's time is the median (the lower of two); None where the ranks kept no times (planner_ranks._timed)."""
    if not all(g.get("times") for g in got):
        return None
    slower = [max(g["times"][i] for g in got) for i in range(1, min(len(g["times"]) for g in got))]
    k = slower.index(statistics.median_low(slower)) + 1
    return k, slower[k - 1]


def _row(m, label, lay, batch, fn, args, probe, sleeper) -> dict:
    """One row: the probe reads the machine for PROBE_S, paused, the planner predicts from that
    reading, the ranks run alone, reading the speed between their steps; the probe reads again
    after them. The row's median step (median_step) is predicted at the harmonic mean of its ranks'
    readings (in_row_speed), the load and woken share as the probe read them before; beside it, at
    their median and at the probe's readings alone."""
    nodes = fn is on_two_nodes
    probe.samples, sleeper.samples = [], []
    before = read_for([probe, sleeper], PROBE_S)
    probe.within([before])
    sleeper.within([before])
    load, share, wake, used, rate = probe.load(sleeper.used()), probe.share(), sleeper.share(), sleeper.used(), probe.rate()
    at = (fitted := H.cpu_here(lay.gpus)).peak_flops * fitted.gemm_efficiency     # the FLOPs per CPU second the fit's rates are at
    speed = rate / at
    # one rank per node, the two nodes on these cores: the other node's rank is one more task
    first = predicted(m, label, lay, batch, nodes, load + nodes, wake, speed)[2]
    got = fn(*args) if nodes else spawn(fn, lay.gpus, args=args, timeout=900)
    probe.samples, sleeper.samples = [], []
    after = read_for([probe, sleeper], PROBE_AFTER_S)
    probe.within([after])
    sleeper.within([after])
    speed_after = probe.rate() / at
    probe_row = row_speed(speed, speed_after)
    over_row = in_row_speed(got, at) or probe_row
    by_median = in_row_speed(got, at, statistics.median) or probe_row
    k, step_meas = median_step(got) or (None, max(g["step"] for g in got))
    cpu_meas = max(g["cpus"][k] for g in got) if k else max(g["cpu"] for g in got)     # that step's CPU seconds
    hw, sw, pred = predicted(m, label, lay, batch, nodes, load + nodes, wake, over_row)
    at_median = predicted(m, label, lay, batch, nodes, load + nodes, wake, by_median)[2]
    by_probe = predicted(m, label, lay, batch, nodes, load + nodes, wake, probe_row)[2]
    idle = predict_layout(m, m.seq, lay, batch, replace(hw, load=0.0), sw)
    free = Params(0.0, 0.0, 0.0)        # CPU seconds only: no stretch, links without wait
    cpu_only = predict_layout(m, m.seq, lay, batch, replace(hw, cores=0, intra=free, inter=free), sw)
    stretch = cpu_stretch(lay, hw)
    r = {"model": m.name, "params": m.params(), "layout": label, "cpu": this_cpu(), "fit": {"cpu": fitted_on(H.CPU_HERE), "rate": at},
         "step_pred": pred.time["total"], "step_pred_before": first.time["total"], "step_idle": idle.time["total"],
         "step_meas": step_meas, "cpu_meas": cpu_meas,
         "cpu_pred": cpu_only.time["total"] - cpu_only.time["bubble"],
         "time_terms": pred.time, "load": hw.load, "share": share, "wake": wake, "sleeper_cores": used, "speed": speed,
         "row_speed": over_row, "median_speed": by_median, "step_pred_median": at_median.time["total"], "rates": [g.get("rates") for g in got],
         "times": [g.get("times") for g in got], "cpus": [g.get("cpus") for g in got], "probe_row_speed": probe_row, "step_pred_probe": by_probe.time["total"],
         "stretch": stretch, "after": {"load": probe.load(sleeper.used()), "share": probe.share(), "wake": sleeper.share(),
                                       "speed": speed_after},
         "mem_pred": pred.memory["total"] - pred.memory["reserved"], "mem_terms": pred.memory,
         "mem_meas": max(g["peak"] for g in got), "mem_per_rank": [g["peak"] for g in got]}
    console.print(f"{r['model']} {label}: load {r['load']:.1f} (after {r['after']['load']:.1f}), woken {r['wake']:.2f}, "
                  f"speed {r['speed']:.2f} → {r['row_speed']:.2f} (ranks) → {r['after']['speed']:.2f}, "
                  f"step {r['step_pred'] / r['step_meas'] - 1:+.0%} (median reading {r['step_pred_median'] / r['step_meas'] - 1:+.0%}, probe before/after {r['step_pred_probe'] / r['step_meas'] - 1:+.0%}, before only {r['step_pred_before'] / r['step_meas'] - 1:+.0%}), "
                  f"memory {r['mem_pred'] / r['mem_meas'] - 1:+.0%}",
                  highlight=False)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, help="steps per row, at least 2: the median is after the first (default 4, --quick 3)")
    ap.add_argument("--json", help="write the rows (predicted terms, measured) to this file")
    ap.add_argument("--only", default="", help="rows whose layout label contains this text (e.g. pp2, Z3)")
    ap.add_argument("--repredict", metavar="JSON", help="run nothing: predict a --json file's rows again (this planner)")
    ap.add_argument("--runs", metavar="JSON", nargs="+", help="run nothing: several --json files' rows predicted again, "
                    "memory also against the median of their measurements")
    a = ap.parse_args(argv)
    if a.runs and a.repredict:
        ap.error("--runs and --repredict: give one (--runs reads one file too)")
    if (a.runs or a.repredict) and (ignored := [f for f, on in (("--quick", a.quick), ("--steps", a.steps is not None),
                                                                 ("--json", a.json), ("--only", a.only)) if on]):
        ap.error(f"{' '.join(ignored)}: {'--runs' if a.runs else '--repredict'} runs nothing, so it takes none of these")
    if a.runs:
        if bad := [p for p in a.runs if not os.path.isfile(p)]:
            ap.error(f"--runs {' '.join(bad)}: no such file (--json files of earlier runs)")
        over_runs(a.runs)
        return 0
    if a.repredict:
        if not os.path.isfile(a.repredict):
            ap.error(f"--repredict {a.repredict}: no such file (a --json file of an earlier run)")
        repredict(a.repredict)
        return 0
    steps = (3 if a.quick else 4) if a.steps is None else a.steps
    if steps < 2 or not any(a.only in r[1] for r in runs(a.quick, steps)):
        why = "" if a.quick else two_nodes_possible()
        ap.error(f"--steps {steps}: expected at least 2" if steps < 2 else f"--only {a.only!r}: no row's layout "
                 f"contains it" + (f" (the 2-node row is left out here: {why})" if why else ""))
    if a.json and (os.path.isdir(a.json) or not os.access(os.path.dirname(os.path.abspath(a.json)), os.W_OK)):
        ap.error(f"--json {a.json}: expected a file in a writable folder (checked before the runs)")
    if (rc := in_own_session("benchmarks.planner_local", argv)) is not None:
        return rc
    rows = measure(a.quick, steps, a.only)
    shares = [r["share"] for r in rows]
    t = Table(title=f"planner vs this machine (CPU ranks, fp32, glibc defaults unless labelled), each busy task got "
                    f"{min(shares) / os.cpu_count():.2f}-{max(shares) / os.cpu_count():.2f} of a core, {os.cpu_count()} cores")
    for c in ("model", "params", "layout", "load", "after", "woken", "speed → row → after", "step ms predicted", "of it waits", "measured",
              "error", "probe before/after", "before only", "CPU ms pred", "CPU meas", "MiB predicted", "measured ", "error "):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["model"], f"{r['params'] / 1e6:.1f} M", r["layout"], f"{r['load']:.1f}", f"{r['after']['load']:.1f}", f"{r['wake']:.2f}",
                  f"{r['speed']:.2f} → {r['row_speed']:.2f} → {r['after']['speed']:.2f}", f"{r['step_pred'] * 1e3:.0f}",
                  f"{r['time_terms'].get('wait', 0.0) * 1e3:.0f}", f"{r['step_meas'] * 1e3:.0f}", f"{r['step_pred'] / r['step_meas'] - 1:+.0%}",
                  f"{r['step_pred_probe'] / r['step_meas'] - 1:+.0%}", f"{r['step_pred_before'] / r['step_meas'] - 1:+.0%}",
                  f"{r['cpu_pred'] * 1e3:.0f}", f"{r['cpu_meas'] * 1e3:.0f}",
                  f"{r['mem_pred'] / 2**20:.0f}", f"{r['mem_meas'] / 2**20:.0f}", f"{r['mem_pred'] / r['mem_meas'] - 1:+.0%}")
    console.print(t)
    errs = [abs(r["step_pred"] / r["step_meas"] - 1) for r in rows], [abs(r["mem_pred"] / r["mem_meas"] - 1) for r in rows]
    console.print(f"median |error|: step time {statistics.median(errs[0]):.0%}, memory {statistics.median(errs[1]):.0%}; "
                  f"misses (time > 25 %, memory > 10 %): "
                  + (", ".join(f"{r['model']} {r['layout']}" for r, et, em in zip(rows, *errs) if et > 0.25 or em > 0.10) or "none"))
    for key, what in (("step_pred_median", "the median of the ranks' readings from the second step on"),
                      ("step_pred_probe", "the probe's readings before and after each row"),
                      ("step_pred_before", "the probe's reading before each row alone")):
        e = [abs(r[key] / r["step_meas"] - 1) for r in rows]
        console.print(f"step time at the speed of {what}: median |error| {statistics.median(e):.0%}, "
                      f"{sum(x > 0.25 for x in e)} of {len(rows)} rows beyond 25 %")
    if a.json:
        atomic_write(a.json, lambda f: f.write(json.dumps(rows, indent=1).encode()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
