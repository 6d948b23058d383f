"""Naive model parallelism: one micro-batch at a time through the whole pipeline and back.

    python -c "from pipeline_parallel.schedules.naive import naive; print(naive(0, 2, 2))"

Stage s: for each micro-batch: receive, forward, send; receive grad, backward, send grad.
Only one stage works at any moment: bubble (p−1)/p whatever m is; one stored activation per
stage. Exists to show what the pipelined schedules fix. Messages per step per stage: 2m
(activation forward, gradient back) on each inner boundary, like every schedule here.
"""
from __future__ import annotations

from pipeline_parallel.schedules.instructions import bwd_ops, check_args, finish, fwd_ops


def naive(stage: int, num_stages: int, micro_batches: int, train: bool = True) -> list:
    check_args("naive", stage, num_stages, micro_batches)
    ops = []
    for mb in range(micro_batches):
        ops += fwd_ops(mb, 0, stage, num_stages)
        if train:
            ops += bwd_ops(mb, 0, stage, num_stages)
    return finish(ops, train)
