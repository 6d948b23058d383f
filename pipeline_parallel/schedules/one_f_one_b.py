"""1F1B (PipeDream-Flush, Narayanan et al. 2021; DeepSpeed's TrainSchedule and Megatron's default).

    python -c "from pipeline_parallel.schedules.one_f_one_b import one_f_one_b; print(one_f_one_b(0, 2, 3))"

Stage s: a warm-up of w = min(p − s − 1, m) forwards, then alternate one forward and one
backward (steady state), then the w remaining backwards (cool-down). Same bubble as GPipe,
(p−1)/(m+p−1), and the same 2m messages per inner boundary, but a stage never holds more than
w + 1 ≤ p micro-batches' activations instead of m.
"""
from __future__ import annotations

from pipeline_parallel.schedules.instructions import bwd_ops, check_args, finish, fwd_ops


def one_f_one_b(stage: int, num_stages: int, micro_batches: int, train: bool = True) -> list:
    check_args("1f1b", stage, num_stages, micro_batches)
    p, m = num_stages, micro_batches
    if not train:
        return [op for mb in range(m) for op in fwd_ops(mb, 0, stage, p)]
    warmup = min(p - stage - 1, m)
    ops = [op for mb in range(warmup) for op in fwd_ops(mb, 0, stage, p)]
    for i in range(m - warmup):
        ops += fwd_ops(warmup + i, 0, stage, p) + bwd_ops(i, 0, stage, p)
    for mb in range(m - warmup, m):
        ops += bwd_ops(mb, 0, stage, p)
    return finish(ops, train)
