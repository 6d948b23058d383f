"""Fit the planner's `cpu-here` hardware file on this machine: the rates of a core's work, each
from a micro-benchmark at calibration shapes that no row of benchmarks.planner_local runs.

    python -m benchmarks.planner_fit                 # writes planner/cpus/PROCESSOR/cpu_here.json (its parts' times below)
    python -m benchmarks.planner_fit --out /tmp/cpu.json --quick

Every rate is CPU time (time.thread_time, one thread, fp32), not wall time: the work a step
costs a core, whatever else shares the cores. How many cores the ranks share, and how many other
runnable tasks, turn CPU seconds into wall seconds (planner.steptime: ×(ranks + load)/cores);
what a CPU second buys still moves with the load (caches, memory, the host's cycles), so
planner.probe measures it when a plan is made and scales these rates by it (at_speed): the
fit's own load stays in it only through that ratio. `--ranks` processes (default 2) measure at
once, as training ranks would (they share caches and memory bandwidth); the medians are kept.

    peak_flops, gemm_efficiency   square matmuls (the best median rate is the peak) and the
                                  transformer-shaped products tokens×h·h×4h (their harmonic mean
                                  over the peak); h = 64, 128, 256 at 256-512 tokens
    mem_bandwidth                 a 64 MiB add (read + write)
    host_adam                     torch's AdamW on 4 M parameters
    op_overhead, elementwise_s    torch.nn.TransformerEncoderLayer forward + backward at three
                                  calibration shapes (h = 64, 128, 192): what is left after its
                                  matmul FLOPs at the fitted GEMM rate, fitted as
                                  op_overhead + elementwise_s × (the layer's saved activation
                                  bytes, planner.memory.torch_layer_activation_bytes) by least squares
    llama_op_overhead,            the same line for Hugging Face's llama decoder layer, fitted on it
    llama_elementwise_s           at three calibration shapes, each timed against torch's layers
                                  above in the same round (benchmarks.planner_fit_llama)
    python -m benchmarks.planner_fit --llama         # only llama's line, into the existing file (~15 s)
    logit_s                       the top (LayerNorm, logits, cross-entropy) forward + backward at
                                  two vocabularies: the rest after the matmuls, per logit element
    vp_loss_s                     tensor_parallel's vocab-parallel cross-entropy over a one-rank
                                  group (its collectives the identity), forward + backward, at the
                                  same T × V: its CPU seconds beyond torch's fused loss's, per
                                  logit element (it writes z − max, exp and the softmax, and its
                                  backward a copy and a product, each a fresh T × V block)
    call_overhead                 CPU seconds of one small all-reduce through ringzero's default
                                  path (its check, plan, and the transport's waits)
    mmap_s, map_layer, map_head   fresh mappings (benchmarks.planner_fit_map): CPU seconds per
                                  byte first touched in a mapped block beyond a reused heap block
                                  (the calibration step mapped against the same at glibc's defaults),
                                  and the bytes a layer (a top) touches afresh per saved byte (per
                                  logit byte) with glibc's mmap threshold at 64 KiB, by page faults
    alloc_slack, zero1_slack,     whole steps (benchmarks.planner_fit_engine): the rows' own
    zero2_slack, pipe_slack,      measurement at a calibration shape, CAL (L 3, h 192, V 12288,
    slack_sigma, step_cpu,        mb 4), 2 ranks: the DDP step's peak beyond the planner's live
    zero3_module_s                bytes, the median of 16 fresh interpreters (each launch draws its
                                  own slack: slack_fit); zero_from_scratch's ZeRO-1 and ZeRO-2
                                  steps there (zero1_slack, zero2_slack) and PIPE_CAL's pipeline
                                  (L 4, pp 2, mb 2, pipe_slack_fit) the same way, per byte of
                                  their largest freed block; slack_sigma, ln(slack)'s spread over
                                  those launches; step_cpu: the median of 5 runs in one: its CPU
                                  seconds over the planner's sum of its parts at the rates above
                                  (a step's ops do not run as alone);
                                  ZeRO-3's CPU beyond ZeRO-1's and beyond the planner's own count of
                                  the difference (fresh pages, calls), per module call
    links                         the shared-memory link per number of ranks (2, 4): an all-reduce
                                  through ringzero's default path at 1 KiB-16 MiB, the ranks lined
                                  up by a tiny all-reduce first, the fastest of `reps` tries (the
                                  run no other task interrupted: the link itself, what an idle
                                  machine gives), read as a ring's 2(n-1)α + 2(n-1)/n·S·β: α from
                                  1 KiB, β the median over ≥ 1 MiB. The planner stretches it by the
                                  load as it does the ranks' compute (planner.steptime.group_time)
    python -m benchmarks.planner_fit --links         # only the links, into the existing file (~1 min)
    wait_s                        the wait a blocking collective pays for a descheduled peer once
                                  runnable tasks outnumber the cores (planner.cpu_host.wait_time):
                                  N = 2, 3, 4, 8 ranks each burn WAIT_WORK of CPU (the probe's
                                  matmuls) then all-reduce 4 bytes, WAIT_ITERS times, the load read
                                  by planner.probe just before (paused while the ranks run); per
                                  iteration, the slower rank's wall time less its CPU seconds
                                  stretched by (N + load)/cores is the wait; wait_s is the
                                  least-squares slope of it over (N − cores)/cores · (cores +
                                  load)/cores, through 0 (planner.cpu_host.wait_time: the ranks'
                                  own oversubscription, each slice stretched by the other
                                  sessions' load). Three runs on an earlier processor gave 1.7,
                                  2.2 and 2.9 ms (at loads 3.2-4.4, 5.6-8.4, 5-11); the file
                                  keeps this processor's whole fit, with its rows
    python -m benchmarks.planner_fit --waits         # only wait_s, into the existing file (~1 min)
    python -m benchmarks.planner_fit --links-median  # the 4-rank link on its fastest and its median try, printed
    python -m benchmarks.planner_fit --engine        # only the mappings, step_cpu and zero3_module_s (~2 min)
    python -m benchmarks.planner_fit --loss          # only vp_loss_s, into the existing file (~10 s)
    slice_cpu                     a rank's CPU seconds per step once the ranks outnumber the cores
                                  (benchmarks.planner_fit_engine.slice_fit)
    python -m benchmarks.planner_fit --slices        # only slice_cpu, into the existing file (~1 min)
    python -m benchmarks.planner_fit --slack         # only the slacks, into the existing file (~20 min)
Across nodes multinode/'s shaped veth (planner.hardware.cpu_here); `cores` from os.cpu_count().
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import primitives as P
from benchmarks.planner_fit_engine import refit_engine, refit_slack, refit_slices
from benchmarks.planner_fit_links import link_fit, wait_fit
from benchmarks.planner_fit_llama import LLAMA, llama_points, llama_sweep, matmul_s, torch_shares
from benchmarks.planner_fit_loss import HEADS, cpu, loss_sweep, vp_loss_fit
from benchmarks.planner_fit_map import head_step, layer_step
from planner.hosts import fit_path, fitted_on, rank_memory, this_cpu, writable, write_fit
from planner.layout import Layout
from planner.memory import torch_layer_activation_bytes
from planner.model import Model
from planner.probe import PRODUCTS
from primitives.launch import spawn
from primitives.log import console

LAYERS = ((64, 4, 256, 32, 2), (128, 4, 512, 64, 4), (192, 4, 768, 64, 4))    # h, heads, f, s, b


def rate(m: int, k: int, n: int, reps: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / cpu(lambda: a @ b, reps)


def mem_rate(nbytes: int, reps: int) -> float:
    x = torch.zeros(nbytes // 4)
    y = torch.zeros_like(x)
    return 2 * nbytes / cpu(lambda: torch.add(x, 1.0, out=y), reps)            # read x, write y


def adam_rate(n: int, reps: int) -> float:
    """Parameters per CPU second torch's AdamW updates (on a CPU it is bound by its sqrt, not memory)."""
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return n / cpu(opt.step, reps)


def layer_cpu(h: int, a: int, f: int, s: int, b: int, reps: int) -> float:
    return cpu(layer_step(h, a, f, s, b), reps)


def head_cpu(T: int, h: int, V: int, reps: int) -> float:
    return cpu(head_step(T, h, V), reps)


def call_cpu(reps: int) -> float:
    x = torch.zeros(16)
    return cpu(lambda: P.all_reduce(x), reps)


def sweep(rank: int, world: int, quick: bool) -> dict:
    torch.set_num_threads(1)
    reps = 3 if quick else 7
    return {"square": [rate(n, n, n, reps) for n in ((256, 512) if quick else (256, 512, 1024))],
            "shaped": [rate(t, h, 4 * h, reps) for t, h, _ in (PRODUCTS[:2] if quick else PRODUCTS)],
            "bw": mem_rate(64 * 2**20, reps), "adam": adam_rate(2**22, reps),
            "layers": [layer_cpu(*shape, reps) for shape in LAYERS], "heads": [head_cpu(*shape, reps) for shape in HEADS],
            **loss_sweep(rank, world, reps),
            "call": call_cpu(20 if quick else 100)}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both kept ≥ 0."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    return max(0.0, my - slope * mx), slope


def with_note(calibrated_on: str, key: str, text: str) -> str:
    """calibrated_on with a partial refit's earlier notes `key …` dropped and `key text` appended,
    every other part kept."""
    return "; ".join([part for part in calibrated_on.split("; ") if not part.startswith(key)] + [f"{key} {text}"])


def llama_fit(doc: dict, ranks: int, quick: bool) -> str:
    """Fit llama's line into `doc` (benchmarks.planner_fit_llama), given torch's line there; returns
    the line to print: the fit, what torch's line would give these layers, and the torch layers'
    shares of a round, timed against their line's (the ratio method's check)."""
    got = spawn(llama_sweep, ranks, args=(LAYERS, 15 if quick else 40), timeout=900)
    points = llama_points(got, doc, LAYERS)
    doc["llama_op_overhead"], doc["llama_elementwise_s"] = fit_line([x for x, _, _ in points], [y for _, y, _ in points])
    torch_err = [(mm + doc["op_overhead"] + x * doc["elementwise_s"]) / (mm + y) - 1 for x, y, mm in points]
    return (f"llama's layer: {doc['llama_op_overhead'] * 1e3:.2f} ms + {doc['llama_elementwise_s'] * 1e9:.2f} ns per saved "
            f"byte (non-matmul {[round(y * 1e3, 2) for _, y, _ in points]} ms; at torch's line these layers would read "
            f"{', '.join(f'{e:+.0%}' for e in torch_err)}; torch's layers' shares of a round timed / by their line "
            f"{', '.join(f'{t:.3f}/{ln:.3f}' for t, ln in torch_shares(got, doc, LAYERS))})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=fit_path("cpu_here.json"), help="default: this processor's file, "
                    f"{fit_path('cpu_here.json')} (planner.hosts)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--ranks", type=int, default=2, help="processes measuring at once (as training ranks)")
    ap.add_argument("--links", action="store_true", help="fit only the links, into the existing --out file")
    ap.add_argument("--waits", action="store_true", help="fit only wait_s, into the existing --out file")
    ap.add_argument("--links-median", action="store_true", help="print the 4-rank link fitted on the fastest and on the "
                                                                  "median try, write nothing")
    ap.add_argument("--engine", action="store_true", help="fit only the mappings and the engine steps' terms "
                    "(zero3_module_s, step_cpu; the slack: --slack)")
    ap.add_argument("--loss", action="store_true", help="fit only vp_loss_s, into the existing --out file")
    ap.add_argument("--slices", action="store_true", help="fit only slice_cpu, into the existing --out file")
    ap.add_argument("--slack", action="store_true", help="fit only the slacks (alloc, zero1, zero2, pipe), into the existing --out file")
    ap.add_argument("--llama", action="store_true", help="fit only llama's layer line, into the existing --out file")
    a = ap.parse_args(argv)
    if a.ranks < 1 or not a.links_median and not writable(a.out):     # --links-median writes nothing
        ap.error(f"--ranks {a.ranks}: expected at least 1" if a.ranks < 1 else f"--out {a.out}: expected a file in a writable folder")
    parts = [flag for flag, on in (("--links", a.links), ("--links-median", a.links_median)) if on]
    if parts and (a.waits or a.engine or a.loss or a.llama or a.slices or a.slack or len(parts) > 1):    # each returns before the others run
        ap.error(f"{parts[0]} runs on its own: expected it without another of --links, --links-median, --waits, "
                 "--engine, --loss, --llama, --slices, --slack")
    load_now = open('/proc/loadavg').read().split()[0]
    if a.links_median:
        for name, stat in (("fastest", min), ("median", statistics.median)):
            p = link_fit(4, stat=stat)
            console.print(f"4 ranks, the {name} try: α {p['alpha'] * 1e6:.0f} µs, {1e-9 / max(p['beta'], 1e-30):.2f} GB/s "
                          f"(load {load_now})")
        return 0
    if a.waits or a.engine or a.loss or a.links or a.llama or a.slices or a.slack:    # a part refitted into a file the rest of which is another processor's: refused
        if not os.path.exists(a.out):
            ap.error(f"{a.out} does not exist: a partial refit updates a whole fit's file; run the whole fit first")
        if (there := fitted_on(a.out)) != this_cpu():
            ap.error(f"{a.out} was fitted on {there or 'a processor it does not name'}, this is {this_cpu()}: a partial "
                     "refit would mix two processors' terms; run the whole fit (python -m benchmarks.planner_fit)")
    if a.waits or a.engine or a.loss or a.llama or a.slices or a.slack:
        with open(a.out) as f:
            doc = json.load(f)
        if a.llama:
            console.print(llama_fit(doc, a.ranks, a.quick) + f" (load {load_now})")
            doc["calibrated_on"] = with_note(doc["calibrated_on"], "llama's line by",
                                             f"python -m benchmarks.planner_fit --llama ({a.ranks} ranks at once, load {load_now})")
        if a.loss:
            vp = vp_loss_fit(spawn(loss_sweep, a.ranks, args=(3 if a.quick else 7,), timeout=900))
            console.print(f"the vocab-parallel loss: {vp * 1e9:.2f} ns per logit element beyond torch's (load {load_now})")
            doc.update(vp_loss_s=vp, calibrated_on=with_note(doc["calibrated_on"], "vp_loss_s by", "python -m benchmarks."
                                                             f"planner_fit --loss ({a.ranks} ranks at once, load {load_now})"))
        if a.waits:
            wait_s, rows = wait_fit()
            console.print(f"wait per blocking collective per unit of oversubscription: {wait_s * 1e3:.2f} ms; "
                          + ", ".join(f"{r['ranks']} ranks at load {r['load']:.1f}: {r['wait_s'] * 1e3:.2f} ms, a rank's CPU "
                                      f"beyond its work {r['cpu_s'] * 1e3:.2f} ms" for r in rows))
            doc.update(wait_s=wait_s, wait_fit={"command": "python -m benchmarks.planner_fit --waits", "rows": rows})
        if a.engine:
            console.print(refit_engine(doc, LAYERS, a.ranks, f"python -m benchmarks.planner_fit --engine, load {load_now}"))
        if a.slices:
            console.print(refit_slices(doc, f"python -m benchmarks.planner_fit --slices, load {load_now}"))
        if a.slack:
            console.print(refit_slack(doc, f"python -m benchmarks.planner_fit --slack, load {load_now}"))
        write_fit(a.out, doc)
        return 0
    links = {str(n): link_fit(n) for n in (2, 4)}
    console.print("links (α µs, GB/s): " + ", ".join(f"{n} ranks {p['alpha'] * 1e6:.0f}, {1e-9 / p['beta']:.2f}"
                                                       for n, p in links.items()))
    if a.links:
        with open(a.out) as f:
            doc = json.load(f)
        write_fit(a.out, {**doc, "links": links, "calibrated_on": with_note(doc["calibrated_on"], "links at",
                                                                             f"load {open('/proc/loadavg').read().split()[0]}")})
        return 0
    got = spawn(sweep, a.ranks, args=(a.quick,), timeout=900)
    med = lambda key: [statistics.median(g[key][i] for g in got) for i in range(len(got[0][key]))]  # noqa: E731
    square, shaped = med("square"), med("shaped")
    peak = max(square + shaped)
    gemm = statistics.harmonic_mean(shaped)
    rest = []
    for (h, heads, f, s, b), t in zip(LAYERS, med("layers")):
        m = Model("cal", 1, h, heads, 2, s, ffn=f)
        rest.append((torch_layer_activation_bytes(m, s, Layout(1, 1, 1, mb=b)),
                     t - matmul_s(m, s, b, gemm)))
    op_overhead, elem_s = fit_line([x for x, _ in rest], [y for _, y in rest])
    logit_s = statistics.mean(max(0.0, t - 6 * T * h * V / gemm) / (T * V) for (T, h, V), t in zip(HEADS, med("heads")))
    vp_loss_s = vp_loss_fit(got)
    wait_s, wait_rows = wait_fit()
    bw = statistics.median(g["bw"] for g in got)
    doc = {"name": "cpu-here", "peak_flops": peak, "memory": rank_memory(), "mem_bandwidth": bw, "gpus_per_node": 8,
           "intra": None, "inter": None, "host_link": bw, "host_adam": statistics.median(g["adam"] for g in got),
           "gemm_efficiency": gemm / peak, "reserved": 350 * 2**20, "bytes_per_elem": 4, "activations": "torch-eager-fp32",
           "cores": os.cpu_count(), "op_overhead": op_overhead, "elementwise_s": elem_s, "logit_s": logit_s,
           "vp_loss_s": vp_loss_s,
           "call_overhead": statistics.median(g["call"] for g in got), "links": links, "wait_s": wait_s,
           "wait_fit": {"command": "python -m benchmarks.planner_fit --waits",
                        "rows": wait_rows},
           "calibrated_on": f"python -m benchmarks.planner_fit (CPU time, {a.ranks} ranks at once, load "
                            f"{open('/proc/loadavg').read().split()[0]}; layers h {[x[0] for x in LAYERS]}, "
                            f"llama layers h {[x[0] for x in LLAMA]}, heads V {[x[2] for x in HEADS]})",
           "cpu": this_cpu(),
           "source": "measured here (links: the fastest all-reduce of each size, benchmarks.planner_fit_links.link_fit)"}
    llama = llama_fit(doc, a.ranks, a.quick)
    engine = refit_engine(doc, LAYERS, a.ranks, "python -m benchmarks.planner_fit")
    engine += "; " + refit_slices(doc, "python -m benchmarks.planner_fit")
    engine += "; " + refit_slack(doc, "python -m benchmarks.planner_fit")
    write_fit(a.out, doc)
    console.print(f"peak {peak / 1e9:.1f} GFLOP/s per CPU second (squares {[round(r / 1e9, 1) for r in square]}, "
                  f"transformer-shaped {[round(r / 1e9, 1) for r in shaped]}), memory {bw / 1e9:.1f} GB/s, "
                  f"Adam {doc['host_adam'] / 1e6:.0f} M params/s, gemm_efficiency {doc['gemm_efficiency']:.2f}\n"
                  f"a layer's non-matmul work: {op_overhead * 1e3:.2f} ms + {elem_s * 1e9:.2f} ns per saved activation byte "
                  f"(residuals {[round(y * 1e3, 2) for _, y in rest]} ms); logits {logit_s * 1e9:.1f} ns per element "
                  f"(+{vp_loss_s * 1e9:.1f} vocab-parallel); {llama}; "
                  f"one collective call {doc['call_overhead'] * 1e6:.0f} µs CPU; {engine}; a blocking collective's wait "
                  f"{wait_s * 1e3:.2f} ms per unit of oversubscription; {doc['cores']} cores → {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
