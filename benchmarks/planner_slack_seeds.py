"""Which slack a launch gets: the allocator's slack of one training process from one launch to the
next, with its string-hash seed and address layout fixed, and as Python starts by default.

    python -m benchmarks.planner_slack_seeds                      # gpt-mini, 8 seeds (~3 min idle)
    python -m benchmarks.planner_slack_seeds --shape gpt-cal --seeds 4 --steps 12

Each launch is a fresh interpreter, as a user's run is. Three sets at benchmarks.planner_ranks's
model of the shape (mb 4, AdamW at torch's defaults, `--steps` steps), the peak resident set above
the pre-model baseline as benchmarks.planner_local reads it (the largest step's):
  fixed   one process, no process group, started with PYTHONHASHSEED=k for k = 1..--seeds and
          the address space unrandomized (setarch -R), each twice: if the peak is the same twice,
          the allocator's calls and their order are set by the hash seed and the addresses;
  random  the same process as Python and Linux start it by default (--seeds launches);
  ranks   planner_local's own DDP row (2 ranks through primitives.launch.spawn) at seed 1,
          unrandomized, --seeds launches: what the ranks' threads and their timing add.
Beside each, the planner's count of that step without the slack (planner.memory at cpu-here with
alloc_slack 0), so peak − count is the slack glibc kept, and the planner's own slack term.
Cost: 4 × --seeds launches of --steps steps (2 ranks in the last set).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

import torch

from benchmarks.planner_ranks import SHAPES, Net, _pp_rank, _rank, _reset_peak, _vm
from planner.hardware import cpu_here
from planner.host_memory import PIPE_CAL, PIPE_CAL_MICRO, SLACK_CAL
from planner.layout import Layout
from planner.memory import memory
from planner.model import Model
from primitives.launch import spawn
from primitives.log import console
from rich.table import Table

MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repository: the launches import from it
MODELS = {m.name: m for m in (*SHAPES, SLACK_CAL, PIPE_CAL)}
MB = 4
CHILD_ZERO = {"ranks": None, "zero1": 1, "zero2": 2}     # a launch's 2 ranks: the DDP row, zero_from_scratch's ZeRO-1 / 2 rows


def _alone(m, steps: int) -> list[int]:
    """One process: planner_ranks._warm's warm-up without its collective and speed reader, then the steps."""
    torch.set_num_threads(1)
    warm = Net(Model("warm", 1, 64, 4, 64, 16, positions=16))     # planner_ranks._warm's
    wopt = torch.optim.AdamW(warm.parameters())
    warm(torch.zeros(1, 16, dtype=torch.long)).sum().backward()
    wopt.step()
    del warm, wopt
    _reset_peak()
    base = _vm("VmRSS")
    torch.manual_seed(0)
    net = Net(m)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(0, m.vocab, (MB, m.seq), generator=torch.Generator().manual_seed(0))
    peaks = []
    for _ in range(steps):
        _reset_peak()
        torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        peaks.append(_vm("VmHWM") - base)
    return peaks


def launch(shape: str, steps: int, mode: str, seed: int | None, module: str = "benchmarks.planner_slack_seeds",
           extra: tuple = ()) -> int:
    """One fresh interpreter's peak (bytes; the larger rank's in modes ranks, zero1, zero2 and pipe) from `module`'s
    child mode; with a seed, its PYTHONHASHSEED and an unrandomized address space, else Python's and
    Linux's defaults."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    fixed = []
    if seed is not None:
        env["PYTHONHASHSEED"] = str(seed)
        fixed = ["setarch", platform.machine(), "-R"]
    cmd = [*fixed, sys.executable, "-m", module, "--child", mode, *(("--shape", shape) if shape else ()), "--steps", str(steps), *extra]
    got = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if got.returncode:
        raise RuntimeError(f"{' '.join(cmd)} (PYTHONHASHSEED={seed if seed is not None else 'random'}) exited {got.returncode}:\n{got.stderr[-2000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])["peak"]


def counts(m) -> dict:
    """The planner's count without slack and its slack term, one process and 2 DDP ranks."""
    out = {}
    for mode, dp in (("alone", 1), ("ranks", 2)):
        hw = cpu_here(dp)
        full = memory(m, m.seq, Layout(dp, 1, 1, mb=MB), dp * MB, hw)
        out[mode] = (full["total"] - full["reserved"] - full["allocator"], full["allocator"])
    return out


def spread(xs: list[float]) -> str:
    med = statistics.median(xs)
    return (f"{min(xs) / MiB:.1f}–{max(xs) / MiB:.1f} MiB, median {med / MiB:.1f} "
            f"({min(xs) / med - 1:+.1%} / {max(xs) / med - 1:+.1%})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gpt-mini", choices=sorted(MODELS), help="the model's shape (default gpt-mini)")
    ap.add_argument("--seeds", type=int, default=8, help="hash seeds 1..N, N random launches, N ranks launches (default 8)")
    ap.add_argument("--steps", type=int, default=4, help="steps per launch; its peak is the largest step's "
                    "(default 4, planner_local's)")
    ap.add_argument("--child", choices=("alone", *CHILD_ZERO, "pipe"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.seeds < 1 or a.steps < 1:
        ap.error(f"--seeds {a.seeds} --steps {a.steps}: expected positive counts")
    m = MODELS[a.shape]
    if a.child == "alone":
        print(json.dumps({"peak": max(_alone(m, a.steps))}))
        return 0
    if a.child in (*CHILD_ZERO, "pipe"):
        got = (spawn(_rank, 2, args=(m, MB, a.steps, CHILD_ZERO[a.child]), timeout=900) if a.child in CHILD_ZERO
               else spawn(_pp_rank, 2, args=(m, 2, PIPE_CAL_MICRO, a.steps), timeout=900))
        print(json.dumps({"peak": max(g["peak"] for g in got)}))
        return 0
    if shutil.which("setarch") is None:
        ap.error("setarch (util-linux) not found: the fixed launches run under setarch -R")
    seeds = range(1, a.seeds + 1)
    alone = {s: [launch(a.shape, a.steps, "alone", s) for _ in range(2)] for s in seeds}
    rand = [launch(a.shape, a.steps, "alone", None) for _ in seeds]
    ranks = [launch(a.shape, a.steps, "ranks", 1) for _ in seeds]
    c = counts(m)
    t = Table(title=f"{m.name}, mb {MB}, {a.steps} steps a launch: peak above the baseline (MiB)")
    for col in ("launch", "peak", "again", "slack (peak − count)"):
        t.add_column(col, justify="left" if col == "launch" else "right")
    for s, (p, q) in alone.items():
        t.add_row(f"fixed, seed {s}", f"{p / MiB:.1f}", f"{q / MiB:.1f}", f"{(p - c['alone'][0]) / MiB:.1f}")
    for i, p in enumerate(rand):
        t.add_row(f"random ({i + 1})", f"{p / MiB:.1f}", "", f"{(p - c['alone'][0]) / MiB:.1f}")
    for i, p in enumerate(ranks):
        t.add_row(f"2 ranks (DDP), fixed, seed 1 ({i + 1})", f"{p / MiB:.1f}", "", f"{(p - c['ranks'][0]) / MiB:.1f}")
    console.print(t)
    same = max(abs(p - q) for p, q in alone.values())
    console.print(f"fixed, each seed twice: the larger difference {same / MiB:.1f} MiB", highlight=False)
    console.print(f"fixed, over seeds: {spread([p for p, _ in alone.values()])}; random: {spread(rand)}; "
                  f"planner's count {c['alone'][0] / MiB:.1f} + slack {c['alone'][1] / MiB:.1f}", highlight=False)
    console.print(f"2 ranks, fixed at seed 1: {spread(ranks)}; planner's count {c['ranks'][0] / MiB:.1f} + slack "
                  f"{c['ranks'][1] / MiB:.1f}", highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
