"""The share of the cores a benchmark's ranks get on a shared machine, measured beside them
(benchmarks.planner_local feeds it to the planner's cpu_stretch as `load`).

    load = Load(); load.start(); ...run the ranks...; load.stop(); load.during(spans); load.load(ranks)

Cost: one more busy process (a core's share) while it runs.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading

PROBE = """import time
while True:
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < 0.1:
        pass
    print(time.time(), (time.thread_time() - c0) / (time.perf_counter() - t0), flush=True)
"""


class Load(threading.Thread):
    """The share of the cores this run's ranks get while a row runs. Linux groups tasks by session
    (sched_autogroup, on here) and shares the cores between the sessions with runnable tasks,
    then within each session between its tasks. A probe in a session of its own spins and
    reports its CPU seconds per wall second every 0.1 s: with S sessions busy on C cores it sees
    p = C / S (≤ 1), the share the ranks' session gets too, so r busy ranks each get p / r of a
    core: the planner's (ranks + load) / cores is r / p with load = C·r/p − r. The probe is one
    more busy session while the row runs (it slows the row as that one would)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples = []
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def run(self):
        for line in self.proc.stdout:
            t, p = line.split()
            self.samples.append((float(t), float(p)))

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        self.join()

    def during(self, spans) -> None:
        """Keep the samples taken while the ranks ran their timed steps (not start-up, not warm-up)."""
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        kept = [x for x in self.samples if lo <= x[0] <= hi]
        self.samples = kept or self.samples

    def share(self) -> float:
        return statistics.mean(x for _, x in self.samples) if self.samples else 1.0

    def load(self, ranks: int) -> float:
        return max(0.0, os.cpu_count() * ranks / self.share() - ranks)
