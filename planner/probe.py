"""What this machine gives a run right now: the share of the cores a session of busy processes
gets, the share a task that sleeps and wakes gets, and the rate of a CPU second (matmul FLOPs per
CPU second), measured while a run runs or just before a plan (the planner's `cpu-now`).

    python -m planner tiny --gpus 2 --hardware cpu-now      # cpu-here, probed for ~3 s first
    probe = Probe(); probe.start(); ...run the ranks...; probe.stop(); probe.during(spans)

Cost: `procs` (default 2, as many as cores here) more busy processes while it runs, a Sleeper one
more, runnable about half the time; ~3 s before a plan.

The probe's processes sit in a session of their own (as a run from its own terminal) and each
repeats the transformer-shaped products planner_fit's
GEMM rate was fitted on (tokens×h by h×4h at h = 64, 128, 256, equal FLOPs each), reporting
every 0.1 s its CPU seconds per wall second and its FLOPs per CPU second:
  share  the cores the probe got, summed over its processes; each busy process got q = share /
         procs. A run's busy ranks each get q too: beside a run, the probe's processes and the
         ranks are runnable tasks alike; alone (cpu-now), q is what each task of a run started now
         would get. The planner's cores / (ranks + load) = q, so load = C / q − r. (Linux's
         autogroup is on here and would share the cores between sessions first, making a
         4-rank session's share the same as the 2-process probe's; the runs show otherwise —
         4-rank rows got 2.4-2.6× the probe's session share under load — and each task's share
         is what predicts both the 2- and the 4-rank rows.) The probe is two more busy tasks
         beside a run and slows it as two would
  woken  (Sleeper, one more process in a session of its own) the share of a core a task that
         sleeps and wakes gets while awake: the scheduler places a woken task by the service it
         did not use, so it runs ahead of busy ones — the share of the ranks that wait inside a
         step (planner.steptime.wake_share)
  speed  the FLOPs per CPU second now over the fitted rate (peak · gemm_efficiency): a CPU second
         buys less work when other processes share the caches, memory and the host's cycles
         (this is a virtual machine), so every fitted CPU-second rate scales by it
         (planner.hardware.at_speed)
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time

PROBE = """import os, sys, time, torch
torch.set_num_threads(1)
for _ in range(int(sys.argv[1]) - 1):
    if os.fork() == 0:
        break
mats = [(torch.randn(t, h), torch.randn(h, 4 * h), k) for t, h, k in ((256, 64, 32), (256, 128, 8), (512, 256, 1))]
per_round = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] * k for a, b, k in mats)
while True:
    t0, c0, n = time.perf_counter(), time.thread_time(), 0
    while time.perf_counter() - t0 < 0.1:
        for a, b, k in mats:
            for _ in range(k):
                a @ b
        n += 1
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    try:
        os.write(1, f"{os.getpid()} {time.time()} {cpu / wall} {n * per_round / cpu}\\n".encode())   # one write: atomic
    except BrokenPipeError:
        break
"""


SLEEPER = """import os, sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(256, 128), torch.randn(128, 512)
burst, nap = float(sys.argv[1]), float(sys.argv[2])
while True:
    t0, cpu, awake = time.perf_counter(), 0.0, 0.0
    while time.perf_counter() - t0 < 0.2:
        w0, c0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - c0 < burst:
            a @ b
        awake += time.perf_counter() - w0
        cpu += time.thread_time() - c0
        time.sleep(nap)
    try:
        os.write(1, f"{os.getpid()} {time.time()} {cpu / awake} 0\\n".encode())
    except BrokenPipeError:
        break
"""


class Probe(threading.Thread):
    """`procs` busy processes in a session of their own (module docstring): their share of the
    cores and the FLOPs per CPU second they get."""

    def __init__(self, procs: int = 2, script: str = PROBE, args: tuple = ()):
        super().__init__(daemon=True)
        self.procs, self.samples = procs, []
        self.proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args or (procs,))],
                                     stdout=subprocess.PIPE, text=True,
                                     start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def run(self):
        for line in self.proc.stdout:
            if len(line.split()) != 4:
                continue
            pid, t, share, rate = line.split()
            self.samples.append((float(t), int(pid), float(share), float(rate)))

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)     # the probe's own process group (its forks too)
        self.proc.wait()
        self.join()

    def during(self, spans) -> None:
        """Keep the samples taken while the ranks ran their timed steps (not start-up, not warm-up)."""
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        kept = [x for x in self.samples if lo <= x[0] <= hi]
        self.samples = kept or self.samples

    def share(self) -> float:
        """Cores the probe's session got: the sum over its processes of each one's mean share."""
        if not self.samples:
            return 1.0
        pids = {x[1] for x in self.samples}
        return sum(statistics.mean(x[2] for x in self.samples if x[1] == p) for p in pids)

    def rate(self) -> float:
        """FLOPs per CPU second of the transformer-shaped products (their total over their CPU seconds)."""
        return statistics.harmonic_mean([x[3] for x in self.samples]) if self.samples else 0.0

    def load(self, ranks: int) -> float:
        """Other runnable tasks, as the planner's (ranks + load) / cores counts them: each busy
        rank gets what each busy probe process gets, q = share / procs, so cores / (ranks + load)
        = q (module docstring: per task, as the runs here show) — but the ranks together get at
        most the cores the probe left, (C − share) / ranks each: when ranks sleep (a pipeline's,
        on a near-idle machine) the probe gets more than a busy rank would."""
        C = os.cpu_count()
        q = min(self.share() / self.procs, max(C - self.share(), 1e-3) / ranks)
        return max(0.0, C / q - ranks)


class Sleeper(Probe):
    """One process in a session of its own that works `burst` CPU seconds, sleeps `nap` seconds,
    and so on, as a pipeline's pacing rank works a micro-batch and waits for its neighbour:
    share() is the share of a core it gets while it is awake (CPU seconds over the wall seconds
    of its bursts), the share a woken rank gets (module docstring)."""

    def __init__(self, burst: float = 0.01, nap: float = 0.01):
        super().__init__(1, SLEEPER, (burst, nap))


def probe_now(seconds: float = 2.0) -> tuple[Probe, float]:
    """cpu-now: as many probe processes as cores and a Sleeper beside them, for `seconds` after
    their start-up: (the probe, the Sleeper's share while awake)."""
    p, s = Probe(os.cpu_count()), Sleeper()
    p.start()
    s.start()
    start = time.time()
    while (len({x[1] for x in p.samples}) < p.procs or not s.samples) and time.time() - start < 60:
        time.sleep(0.05)
    t0 = time.time()
    time.sleep(seconds)
    p.stop()
    s.stop()
    p.during([(t0, time.time())])
    s.during([(t0, time.time())])
    return p, s.share()
