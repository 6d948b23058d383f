"""Pipeline schedules as pure functions; `build(name, stage, p, m, v)` picks one by its config name.

    python -c "from pipeline_parallel.schedules import build; print(build('gpipe', 0, 2, 2))"

naive (bubble (p−1)/p) → GPipe → 1F1B (both (p−1)/(m+p−1)) → interleaved 1F1B ((p−1)/(v·m+p−1)).
"""
from pipeline_parallel.schedules.gpipe import gpipe
from pipeline_parallel.schedules.instructions import Instruction, ScheduleError, bubble_formula, check_args
from pipeline_parallel.schedules.interleaved import interleaved
from pipeline_parallel.schedules.naive import naive
from pipeline_parallel.schedules.one_f_one_b import one_f_one_b

SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def build(name: str, stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1, train: bool = True):
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; allowed: {list(SCHEDULES)}")
    check_args(name, stage, num_stages, micro_batches, virtual_stages)
    if name == "interleaved":
        return interleaved(stage, num_stages, micro_batches, virtual_stages, train=train)
    if virtual_stages != 1:
        raise ScheduleError(f"schedule {name!r} runs one chunk per stage; virtual_stages={virtual_stages} "
                            "needs schedule 'interleaved'")
    return SCHEDULES[name](stage, num_stages, micro_batches, train=train)
