"""How a CPU host's cores turn a rank's CPU seconds into wall seconds (hardware cpu-here / cpu-now):
the share of a core busy and woken ranks get, the pipeline's pacing ranks, the wait a blocking
collective pays for a descheduled member once ranks outnumber the cores, and what a rank's CPU
seconds grow by then.

    python -m planner tiny --gpus 4 --hardware cpu-now        # the load and woken share probed now

Used by planner.steptime; on a GPU (hw.cores = 0) every function returns 1 (stretch, factor) or 0 (wait).
Cost: arithmetic.
"""
from __future__ import annotations


def session_cores(lay, hw) -> float:
    """Cores the ranks of a node get on a CPU host: `cores` shared with `load` other runnable
    tasks, each rank busy at once getting cores / (ranks + load) (what planner.probe measures)."""
    r = min(lay.gpus, hw.gpus_per_node)
    return hw.cores * r / (r + hw.load)


def cpu_stretch(lay, hw) -> float:
    """Wall seconds per CPU second of a rank's compute: 1 on a GPU; on a CPU host, where the ranks
    of a node and `load` other runnable tasks share `cores`, the scheduler gives each runnable task
    cores / (ranks + load) of a core once they outnumber the cores."""
    if not hw.cores:
        return 1.0
    return max(1.0, (min(lay.gpus, hw.gpus_per_node) + hw.load) / hw.cores)


def wake_share(lay, hw, ranks: float) -> float:
    """Share of a core each of `ranks` ranks that wait inside the step gets while awake: a rank
    asleep on a futex (its neighbour's activation, its tensor-parallel peers' all-reduce) is
    served ahead of busy tasks when it wakes (the scheduler places a woken task by the service it
    did not use), which planner.probe.Sleeper measures (hw.wake_share); never below a busy task's
    share, never more than a core, and those ranks together never more than the cores."""
    busy = 1.0 / cpu_stretch(lay, hw)
    return max(busy, min(1.0, hw.wake_share or busy, hw.cores / max(ranks, 1.0)))


def pipeline_stretch(lay, hw) -> float:
    """Wall seconds per CPU second of the ranks that pace the pipelines on a CPU host. The ranks'
    session gets P cores (session_cores). A pipeline rank waiting for its neighbour sleeps on a
    futex and uses no CPU, so the P cores go to the runnable ranks: at least the r/p pacing ranks
    (one per pipeline on the node), each at most one core: min(1, P·p/r). Other stages running
    beside them take their share too; that is the `cores` term of step_time (all ranks' CPU
    seconds over P), which binds instead when it is the larger. A pacing rank also sleeps (for its
    neighbour) and wakes, so it gets at least what a woken task gets (wake_share, measured by
    planner.probe.Sleeper). Nothing fitted: P and the woken share from the probes, r and p from
    the layout."""
    if not hw.cores or lay.pp == 1:
        return cpu_stretch(lay, hw)
    pacing = max(1.0, min(lay.gpus, hw.gpus_per_node) / lay.pp)
    return 1.0 / max(min(1.0, session_cores(lay, hw) / pacing), wake_share(lay, hw, pacing))


def tp_stretch(lay, hw) -> float:
    """Wall seconds per CPU second of tensor-parallel ranks on a CPU host. Each waits for its
    peers in every layer's all-reduces; once the ranks on the node outnumber the cores the
    shared-memory transport gives the core up at once in a wait and sleeps
    (primitives.engine.shm_segment.yield_s, max_polls), so each rank gets a woken task's share
    (wake_share); with a core per rank it polls first and is counted busy (cpu_stretch)."""
    r = min(lay.gpus, hw.gpus_per_node)
    if not hw.cores or lay.tp == 1 or r <= hw.cores:
        return cpu_stretch(lay, hw)
    return 1.0 / wake_share(lay, hw, r)


def slice_factor(lay, hw) -> float:
    """CPU seconds of a rank's step's ops per CPU second of the same with a core per rank: once the
    node's r ranks time-slice its C cores, 1 + slice_cpu·(1 − C/r), slice_cpu fitted on the DDP step
    at a calibration shape on C, 2C and 4C ranks (benchmarks.planner_fit --slices); it scales the
    rates planner.hardware.per_step scales (a page fault's and ZeRO-3's per-module cost are left as
    fitted). 1 with a core per rank, on a GPU, or where the file has no slice_cpu. Other sessions'
    tasks are not counted (the fit measures the ranks' own time-slicing, the machine otherwise idle)."""
    r = min(lay.gpus, hw.gpus_per_node)
    if not hw.cores or r <= hw.cores or not hw.slice_cpu:
        return 1.0
    return 1.0 + hw.slice_cpu * (1.0 - hw.cores / r)


def wait_time(lay, hw, k: int) -> float:
    """Seconds one blocking collective of k ranks waits for a descheduled member on a CPU host.
    The node's r ranks time-slice C cores once r > C: a collective of all r waits behind
    (r − C)/C of their slices, each stretched by the other sessions' tasks sharing the cores,
    (C + load)/C — hw.wait_s·(r − C)/C·(C + load)/C, wait_s (about a scheduler slice) fitted once
    by benchmarks.planner_fit --waits, where all 2, 3, 4 or 8 busy ranks meet in each call. A
    group of k of them waits only for its own k − 1 others: (k − 1)/(r − 1) of that. None with a
    core per rank (2 ranks beside a load of 2-8 waited 0.5 ms or less in three runs of four there,
    6.3 ms in one: a session's ranks are mostly descheduled together) or on a GPU."""
    r = min(lay.gpus, hw.gpus_per_node)
    if not hw.cores or r <= hw.cores or k <= 1:
        return 0.0
    return hw.wait_s * (r - hw.cores) / hw.cores * (hw.cores + hw.load) / hw.cores * (min(k, r) - 1) / (r - 1)
