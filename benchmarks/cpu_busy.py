"""How busy a command keeps this machine's cores: is a run bound by CPU, or by processes waiting?

    python -m benchmarks.cpu_busy -- python -m pytest -q -n 2 --dist loadgroup tests/test_zero_stage3.py
    python -m benchmarks.cpu_busy --runs 2 -- CMD ...     (the command again, each row its own)

Reads /proc/stat (Linux) before and after the command: the machine's busy and idle jiffies, whatever ran,
so run it with nothing else on the machine. Prints the wall time, the CPU seconds all cores spent busy, and
busy / (busy + idle): near 1, more parallel workers only share the same cores (the suite's `make test`
keeps two workers on two cores for that reason); well below 1, processes wait on each other.
Cost: the command itself, plus two reads of /proc/stat.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table


def jiffies() -> tuple[int, int]:
    """(busy, idle) jiffies of all cores since boot: idle counts idle and iowait."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v[:8]) - idle, idle


def measure(cmd: list[str]) -> dict:
    b0, i0 = jiffies()
    t0 = time.perf_counter()
    rc = subprocess.run(cmd).returncode
    wall = time.perf_counter() - t0
    b1, i1 = jiffies()
    hz = os.sysconf("SC_CLK_TCK")
    busy, idle = b1 - b0, i1 - i0
    return {"rc": rc, "wall": wall, "cpu": busy / hz, "busy": busy / max(1, busy + idle)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="run the command this many times, one row each")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    if a.runs < 1:
        ap.error(f"--runs {a.runs}: expected at least 1")
    if not os.path.exists("/proc/stat"):
        sys.exit("error: /proc/stat not found: cpu_busy reads Linux's per-core counters")
    rows = [measure(cmd) for _ in range(a.runs)]
    Console().print(" ".join(cmd), highlight=False, soft_wrap=True)
    t = Table(title=f"{os.cpu_count()} cores, 1-minute load average at the end {os.getloadavg()[0]:.1f}")
    for c in ("run", "exit", "wall s", "busy CPU s", "busy"):
        t.add_column(c, justify="right")
    for k, r in enumerate(rows):
        t.add_row(str(k + 1), str(r["rc"]), f"{r['wall']:.1f}", f"{r['cpu']:.1f}", f"{r['busy']:.1%}")
    Console().print(t)
    return max(r["rc"] for r in rows)


if __name__ == "__main__":
    sys.exit(main())
