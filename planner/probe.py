"""What this machine gives a run right now: the share of a core a busy task gets, the share a task
that sleeps and wakes gets, and the rate of a CPU second (matmul FLOPs per CPU second), read just
before and just after a run (paused while it runs) or just before a plan (the planner's `cpu-now`);
Rate reads the same rate inside a run's own processes, between its steps; in_own_session starts
a run as a session of its own, as the probe's processes are.

    python -m planner tiny --gpus 2 --hardware cpu-now      # cpu-here, probed for ~3 s first
    p = Probe(); p.start(); p.ready(); p.pause(); w = [read_for([p], 1.5)]; ...run...; w.append(read_for([p], 1.5)); p.within(w)

Cost: as many busy processes as cores (and a Sleeper, runnable about half the time) while they
read; nothing while paused: the ranks run without them. ~3 s per read.

The probe's processes sit in a session of their own (as a run from its own terminal) and each
repeats the transformer-shaped products planner_fit's GEMM rate was fitted on (tokens×h by h×4h
at h = 64, 128, 256, equal FLOPs each), reporting every 0.1 s its CPU seconds per wall second and
its FLOPs per CPU second, with the window's start and end (a window that spans a pause is dropped):
  share  the cores the probe got, summed over its processes; each busy process got q = share /
         procs. With as many busy processes as cores the cores are all taken, so what the probe
         (and the Sleeper beside it) did not get went to other runnable tasks: load = (C − share −
         Sleeper's cores) / q of them, counted as busy tasks (Probe.load). The probe's own
         processes are not in it: the ranks run while the probe is paused, r of them beside that
         load, each at C / (r + load) of a core (planner.cpu_host.cpu_stretch). (Linux's autogroup
         is on here and would share the cores between sessions first; the runs show each task's
         share is what predicts both the 2- and the 4-rank rows.)
  woken  (Sleeper, one more process in a session of its own, beside the busy probe as a waiting
         rank is beside busy ranks) the share of a core a task that sleeps and wakes gets while
         awake: the scheduler places a woken task by the service it did not use, so it runs ahead
         of busy ones — the share of the ranks that wait inside a step (planner.cpu_host.wake_share)
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

PRODUCTS = ((256, 64, 32), (256, 128, 8), (512, 256, 1))   # (tokens, h, times): tokens×h by h×4h, equal FLOPs each

PROBE = """import ctypes, os, sys, time, torch
torch.set_num_threads(1)
for _ in range(int(sys.argv[1]) - 1):
    if os.fork() == 0:
        break
ctypes.CDLL(None).prctl(1, 9)      # PR_SET_PDEATHSIG, SIGKILL: gone with its parent, paused or not
mats = [(torch.randn(t, h), torch.randn(h, 4 * h), k) for t, h, k in %r]
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
        os.write(1, f"{os.getpid()} {time.time() - wall} {time.time()} {cpu / wall} {n * per_round / cpu}\\n".encode())   # one write: atomic
    except BrokenPipeError:
        break
""" % (PRODUCTS,)


SLEEPER = """import ctypes, os, sys, time, torch
torch.set_num_threads(1)
ctypes.CDLL(None).prctl(1, 9)      # PR_SET_PDEATHSIG, SIGKILL
a, b = torch.randn(256, 128), torch.randn(128, 512)
burst, nap = float(sys.argv[1]), float(sys.argv[2])
while True:
    t0, cpu, awake, w = time.perf_counter(), 0.0, 0.0, time.time()
    while time.perf_counter() - t0 < 0.2:
        w0, c0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - c0 < burst:
            a @ b
        awake += time.perf_counter() - w0
        cpu += time.thread_time() - c0
        time.sleep(nap)
    try:
        os.write(1, f"{os.getpid()} {w} {time.time()} {cpu / awake} {cpu / (time.perf_counter() - t0)}\\n".encode())
    except BrokenPipeError:
        break
"""


class Rate:
    """The probe's products inside a process that has work of its own (a rank between its steps):
    read() runs them for `cpu_s` CPU seconds and returns their FLOPs per CPU second, the rate the
    probe's processes report, at one thread as theirs. The outputs are made, and the products run
    once (their kernels' pages), here: a rank makes it before its memory baseline, and a reading
    allocates nothing."""

    def __init__(self, cpu_s: float = 0.05):
        import torch      # here, not at import: the planner's own start (cpu-now) has no use for it
        self.cpu_s, self.torch = cpu_s, torch
        self.mats = [(torch.randn(t, h), torch.randn(h, 4 * h), torch.empty(t, 4 * h), k) for t, h, k in PRODUCTS]
        self.per_round = sum(2 * t * h * 4 * h * k for t, h, k in PRODUCTS)
        self.read()       # the first pass touches the outputs' pages and loads the kernels: not a reading

    def read(self) -> float:
        threads = self.torch.get_num_threads()
        self.torch.set_num_threads(1)      # thread_time counts this thread's CPU only
        c0, n = time.thread_time(), 0
        while (cpu := time.thread_time() - c0) < self.cpu_s:
            for a, b, out, k in self.mats:
                for _ in range(k):
                    self.torch.matmul(a, b, out=out)
            n += 1
        self.torch.set_num_threads(threads)
        return n * self.per_round / cpu


class Probe(threading.Thread):
    """`procs` busy processes in a session of their own (module docstring): their share of the
    cores and the FLOPs per CPU second they get. pause() / resume() stop and continue them
    (SIGSTOP / SIGCONT), so they read the machine before and after a run and not beside it."""

    def __init__(self, procs: int = 2, script: str = PROBE, args: tuple = ()):
        super().__init__(daemon=True)
        self.procs, self.samples = procs, []
        self.proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args or (procs,))],
                                     stdout=subprocess.PIPE, text=True,
                                     start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def run(self):
        for line in self.proc.stdout:
            if len(line.split()) != 5:
                continue
            pid, t0, t1, share, rate = line.split()
            self.samples.append((float(t0), float(t1), int(pid), float(share), float(rate)))

    def ready(self, timeout: float = 60.0) -> None:
        """Wait until every process has reported once (past torch's import)."""
        start = time.time()
        while len({x[2] for x in self.samples}) < self.procs and time.time() - start < timeout:
            time.sleep(0.05)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)     # the probe's own process group (its forks too)
        os.killpg(self.proc.pid, signal.SIGCONT)     # a paused group acts on it once continued
        self.proc.wait()
        self.join()

    def within(self, windows) -> None:
        """Keep the samples taken wholly inside one of `windows` ((start, end) times): a sample that
        spans a pause reads the stopped time as a share not got."""
        kept = [x for x in self.samples if any(lo <= x[0] and x[1] <= hi for lo, hi in windows)]
        self.samples = kept or self.samples

    def share(self) -> float:
        """Cores the probe's session got: the sum over its processes of each one's mean share."""
        if not self.samples:
            return 1.0
        pids = {x[2] for x in self.samples}
        return sum(statistics.mean(x[3] for x in self.samples if x[2] == p) for p in pids)

    def rate(self) -> float:
        """FLOPs per CPU second of the transformer-shaped products (their total over their CPU seconds)."""
        return statistics.harmonic_mean([x[4] for x in self.samples]) if self.samples else 0.0

    def load(self, beside: float = 0.0) -> float:
        """Other runnable tasks, counted as busy tasks, as the planner's (ranks + load) / cores counts
        them: the cores neither the probe's processes (share) nor `beside` (the Sleeper's cores,
        Sleeper.used) got, over what each busy probe process got, q = share / procs. The probe
        runs alone (before and after a run, or before a plan), as many busy processes as cores, so
        the cores are all taken and what it did not get went to the other tasks; its own processes
        are not counted, since the ranks will run without them."""
        q = self.share() / self.procs
        return max(0.0, (os.cpu_count() - self.share() - beside) / max(q, 1e-3))


class Sleeper(Probe):
    """One process in a session of its own that works `burst` CPU seconds, sleeps `nap` seconds,
    and so on, as a pipeline's pacing rank works a micro-batch and waits for its neighbour:
    share() is the share of a core it gets while it is awake (CPU seconds over the wall seconds
    of its bursts), the share a woken rank gets (module docstring); used() the cores it took."""

    def __init__(self, burst: float = 0.01, nap: float = 0.01):
        super().__init__(1, SLEEPER, (burst, nap))

    def used(self) -> float:
        return statistics.mean(x[4] for x in self.samples) if self.samples else 0.0


def read_for(probes, seconds: float) -> tuple[float, float]:
    """Continue the paused `probes`, let them read the machine for `seconds`, pause them: the window."""
    t0 = time.time()
    for p in probes:
        p.resume()
    time.sleep(seconds)
    for p in probes:
        p.pause()
    return t0, time.time()


def probe_now(seconds: float = 2.0) -> tuple[Probe, float, float]:
    """cpu-now: as many probe processes as cores and a Sleeper beside them, for `seconds` after
    their start-up: (the probe, the Sleeper's share while awake, the cores the Sleeper took)."""
    p, s = Probe(os.cpu_count()), Sleeper()
    p.start()
    s.start()
    p.ready()
    s.ready()
    t0 = time.time()
    time.sleep(seconds)
    p.stop()
    s.stop()
    p.within([(t0, time.time())])
    s.within([(t0, time.time())])
    return p, s.share(), s.used()


def in_own_session(module: str, argv) -> int | None:
    """Run `python -m module argv` again as a session of its own (a user's run from its own
    terminal) unless this process leads one, as planner.probe's processes are: with the
    scheduler's autogroup on, ranks grouped with other work could get a share the probe cannot
    see. Returns the child's exit status, or None when already in its own session."""
    if os.getsid(0) == os.getpid():
        return None
    child = subprocess.Popen([sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)],
                             start_new_session=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return child.wait()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait()
