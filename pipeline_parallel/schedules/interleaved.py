"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v model chunks per rank.

    python -c "from pipeline_parallel.schedules.interleaved import interleaved; print(interleaved(0, 2, 2, 2))"

Rank s holds virtual stages s, s + p, …, s + (v−1)p. Micro-batches go through in groups of p:
forward step k runs micro-batch (k // pv)·p + k mod p on chunk (k mod pv) // p; backward steps
use the chunks in reverse. Warm-up: (p − s − 1)·2 + (v − 1)·p forward steps (all m·v of them
when m = p), then one forward / one backward, then the cool-down. Each chunk is 1/v of a stage,
so the fill and drain shrink by v: bubble (p−1)/(v·m + p − 1). Price: v times the messages,
2·m·v per rank per step, and more activations in flight than 1F1B. Needs m to be a multiple of p
(Megatron's rule), so every group of p micro-batches fills the pipeline.
"""
from __future__ import annotations

from pipeline_parallel.schedules.instructions import ScheduleError, bwd_ops, check_args, finish, fwd_ops


def interleaved(stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 2, train: bool = True) -> list:
    check_args("interleaved", stage, num_stages, micro_batches, virtual_stages)
    p, m, v = num_stages, micro_batches, virtual_stages
    if m % p:
        raise ScheduleError(f"interleaved: micro_batches (gradient_accumulation_steps) = {m} must be a multiple of "
                            f"the number of stages {p}")

    def mb_chunk(k: int, forward: bool) -> tuple[int, int]:
        c = (k % (p * v)) // p
        return (k // (p * v)) * p + k % p, (c if forward else v - 1 - c)

    total = m * v
    if not train:
        return [op for k in range(total) for op in fwd_ops(*mb_chunk(k, True), stage, p, v)]
    warmup = total if m == p else min((p - stage - 1) * 2 + (v - 1) * p, total)
    ops = [op for k in range(warmup) for op in fwd_ops(*mb_chunk(k, True), stage, p, v)]
    for i in range(total - warmup):
        ops += fwd_ops(*mb_chunk(warmup + i, True), stage, p, v) + bwd_ops(*mb_chunk(i, False), stage, p, v)
    for k in range(total - warmup, total):
        ops += bwd_ops(*mb_chunk(k, False), stage, p, v)
    return finish(ops, train)
