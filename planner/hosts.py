"""Which processor this machine has, and where the planner keeps each processor's fitted files.

    python -m benchmarks.planner_mem_probe    # its runtime pages, llama's slack → planner/cpus/PROCESSOR/cpu_mem.json
    python -m benchmarks.planner_fit          # its rates → planner/cpus/PROCESSOR/cpu_here.json (after the
                                              # probe: the fit's slack is a peak less the count with its pages)

A CPU host's fitted terms are CPU seconds and resident bytes of one processor's work: matmuls,
memory-bound ops and Python's per-op cost each move differently from one model to another, and
the kernels whose code pages a rank maps follow its instruction set. So each processor has a
folder of its own under planner/cpus/, named from /proc/cpuinfo (slug), and `cpu-here` reads the
folder of the processor it runs on. The folder's name holds the core count as well: the rates are
fitted with as many busy ranks as cores. Where the repository has none for this processor, the
planner reads SHIPPED's and says so once per file (check_cpu); the core count and memory it plans
with are still this machine's (planner.hardware.cpu_here).

Cost: one read of /proc/cpuinfo (cached) and of /proc/meminfo per fit loaded.
"""
from __future__ import annotations

import functools
import json
import os
import re
import sys

from zero_from_scratch.engine.atomic import atomic_write

CPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpus")
SHIPPED = "intel-xeon-processor-f6-m207-s2-2c"     # read where this processor has none: tutorial 15's local tables' machine


@functools.lru_cache(maxsize=None)
def this_cpu() -> str:
    """This machine's processor as /proc/cpuinfo names it, with its family/model/stepping and core
    count (a virtual machine's model name is often generic, the numbers are not)."""
    info, cores = {}, os.cpu_count()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        return f"unknown ({cores} cores)"
    if "model name" not in info and "CPU part" in info:      # Arm: implementer, part and revision name the core
        return (f"Arm (implementer {info.get('CPU implementer', '?')}, part {info['CPU part']}, "
                f"revision {info.get('CPU revision', '?')}, {cores} cores)")
    return (f"{info.get('model name', 'unknown')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')}, "
            f"stepping {info.get('stepping', '?')}, {cores} cores)")


def slug(cpu: str) -> str:
    """A folder name for a processor as this_cpu names it:
    'Intel(R) Xeon(R) Processor (family 6, model 207, stepping 2, 2 cores)' → 'intel-xeon-processor-f6-m207-s2-2c'."""
    s = re.sub(r"\((r|tm)\)", "", cpu.lower())
    for word, short in (("(family ", "(f"), (", model ", ", m"), (", stepping ", ", s"), (" cores)", "c)")):
        s = s.replace(word, short)
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-")


def fit_path(name: str) -> str:
    """Where a fit made on this machine writes `name` (cpu_here.json, cpu_mem.json)."""
    return os.path.join(CPUS, slug(this_cpu()), name)


def fitted_path(name: str) -> str:
    """The `name` file the planner reads: this processor's where the repository has one, else SHIPPED's."""
    mine = fit_path(name)
    return mine if os.path.exists(mine) else os.path.join(CPUS, SHIPPED, name)


def fitted_on(path: str) -> str | None:
    """The processor a fitted file names (its `cpu`, as this_cpu wrote it); None where it names none."""
    with open(path) as f:
        return json.load(f).get("cpu")


def rank_memory() -> float | None:
    """The memory a CPU rank plans against: half this machine's (MemTotal), as two ranks share it;
    None where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024 / 2
    except (OSError, ValueError, IndexError):
        return None


def writable(path: str) -> bool:
    """Whether a fit can write the file `path`: not a folder, in a writable folder, or in a
    processor's folder under CPUS that write_fit makes on its first fit."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) and os.path.dirname(folder) == os.path.abspath(CPUS):
        folder = CPUS
    return not os.path.isdir(path) and os.path.isdir(folder) and os.access(folder, os.W_OK)


def write_fit(path: str, doc: dict) -> None:
    """A fit's file, whole or not at all (a temporary file renamed onto it); a processor's folder
    under CPUS made first."""
    if os.path.dirname(folder := os.path.dirname(os.path.abspath(path))) == os.path.abspath(CPUS):
        os.makedirs(folder, exist_ok=True)
    atomic_write(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))


_WARNED: set = set()


def check_cpu(path: str, there: str | None) -> None:
    """Say once per file, on stderr, when a fitted file read here (`path`) was fitted on another
    processor `there`: its CPU seconds and pages are that processor's, so the planner's cpu-here
    times and memory need not hold here."""
    here = this_cpu()
    if there == here or (path, there) in _WARNED:
        return
    _WARNED.add((path, there))
    said = f"was fitted on {there}" if there else "does not say which processor it was fitted on"
    print(f"[planner] {path} {said}; this machine is {here}: its CPU-second rates and pages may not hold here "
          f"(fit this processor with `python -m benchmarks.planner_mem_probe`, ~3 min idle, then "
          f"`python -m benchmarks.planner_fit`, ~4 min: they write {os.path.dirname(fit_path('cpu_here.json'))}/)",
          file=sys.stderr)
