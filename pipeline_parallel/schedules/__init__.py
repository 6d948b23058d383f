"""Pipeline schedules as pure functions; `build(name, stage, p, m, v)` picks one by its config name."""
from pipeline_parallel.schedules.base import Op, ScheduleError, bubble_formula, simulate
from pipeline_parallel.schedules.gpipe import gpipe
from pipeline_parallel.schedules.interleaved import interleaved
from pipeline_parallel.schedules.naive import naive
from pipeline_parallel.schedules.one_f_one_b import one_f_one_b

SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def build(name: str, stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1, train: bool = True):
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; allowed: {list(SCHEDULES)}")
    if name == "interleaved":
        return interleaved(stage, num_stages, micro_batches, virtual_stages, train=train)
    if virtual_stages != 1:
        raise ScheduleError(f"schedule {name!r} runs one chunk per stage; virtual_stages={virtual_stages} "
                            "needs schedule 'interleaved'")
    return SCHEDULES[name](stage, num_stages, micro_batches, train=train)


def programs(name: str, num_stages: int, micro_batches: int, virtual_stages: int = 1, train: bool = True,
             backend: str = "gloo") -> list:
    """Every stage's instruction list; for nccl, receives reordered so per-peer queues pair up."""
    progs = [build(name, s, num_stages, micro_batches, virtual_stages, train) for s in range(num_stages)]
    if backend == "nccl" and num_stages > 1:
        from pipeline_parallel.schedules.base import legalize_for_nccl
        progs = legalize_for_nccl(progs, micro_batches, virtual_stages)
    return progs


__all__ = ["programs", "Op", "ScheduleError", "SCHEDULES", "build", "simulate", "bubble_formula",
           "naive", "gpipe", "one_f_one_b", "interleaved"]
