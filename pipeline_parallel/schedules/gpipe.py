"""GPipe: all forwards, then all backwards (Huang et al. 2019, "all-forward-all-backward").

    python -c "from pipeline_parallel.schedules.gpipe import gpipe; print(gpipe(0, 2, 2))"

Stage s: forward micro-batches 0 … m−1, then backward 0 … m−1. With forward time F and
backward B per micro-batch and stage, the step takes (m + p − 1)(F + B): bubble (p−1)/(m+p−1).
Every stage stores the activations of all m micro-batches at the peak — the memory cost 1F1B
removes. Messages per step: 2m per inner boundary.
"""
from __future__ import annotations

from pipeline_parallel.schedules.instructions import bwd_ops, check_args, finish, fwd_ops


def gpipe(stage: int, num_stages: int, micro_batches: int, train: bool = True) -> list:
    check_args("gpipe", stage, num_stages, micro_batches)
    ops = [op for mb in range(micro_batches) for op in fwd_ops(mb, 0, stage, num_stages)]
    if train:
        ops += [op for mb in range(micro_batches) for op in bwd_ops(mb, 0, stage, num_stages)]
    return finish(ops, train)
