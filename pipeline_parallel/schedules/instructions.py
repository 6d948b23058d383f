"""A pipeline instruction, and the pieces every schedule builds its list from.

    python -c "from pipeline_parallel.schedules import build; print(build('1f1b', 0, 2, 3))"

A schedule is a pure function (stage, num_stages, micro_batches[, virtual_stages]) -> list[Instruction];
pipeline_parallel/executor.py runs it. Kinds, for micro-batch `mb` on local chunk `chunk` (virtual
stage g = chunk·p + stage): recv_act fwd send_act (its forward), recv_grad bwd send_grad (its
backward); reduce_tied reduce_grads step once per batch. Cost, whatever the order: one activation
down and one gradient up per micro-batch and chunk across each inner boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

SENDS = {"send_act": "recv_act", "send_grad": "recv_grad"}
FINAL = ("reduce_tied", "reduce_grads", "step")


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's schedule: `kind` (an Executor method) for micro-batch `mb` on chunk `chunk`."""
    kind: str
    mb: int = -1
    chunk: int = 0

    def __repr__(self):
        return f"{self.kind}({self.mb},{self.chunk})" if self.mb >= 0 else self.kind


def check_args(name: str, stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ScheduleError(f"{name}: num_stages must be a positive int, got {num_stages!r}")
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ScheduleError(f"{name}: stage must be in 0..{num_stages - 1}, got {stage!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ScheduleError(f"{name}: micro_batches (gradient_accumulation_steps) must be >= 1, got {micro_batches!r}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ScheduleError(f"{name}: virtual_stages must be an int >= 1, got {virtual_stages!r}")


def fwd_ops(mb: int, chunk: int, stage: int, p: int, v: int = 1) -> list[Instruction]:
    """Receive the activation (not on the first virtual stage), forward, send (not on the last)."""
    g = chunk * p + stage
    return ([Instruction("recv_act", mb, chunk)] if g > 0 else []) + [Instruction("fwd", mb, chunk)] + \
           ([Instruction("send_act", mb, chunk)] if g < p * v - 1 else [])


def bwd_ops(mb: int, chunk: int, stage: int, p: int, v: int = 1) -> list[Instruction]:
    """Receive the output's gradient (not on the last virtual stage), backward, send the input's."""
    g = chunk * p + stage
    return ([Instruction("recv_grad", mb, chunk)] if g < p * v - 1 else []) + [Instruction("bwd", mb, chunk)] + \
           ([Instruction("send_grad", mb, chunk)] if g > 0 else [])


def peer(op: Instruction, stage: int, p: int) -> int:
    """The pipeline rank a send/recv talks to: activations go down (stage + 1), gradients up."""
    down = op.kind in ("send_act", "recv_grad")
    return (stage + (1 if down else -1)) % p


def finish(ops: list[Instruction], train: bool = True) -> list[Instruction]:
    return ops + ([Instruction(k) for k in FINAL] if train else [])


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of GPipe / 1F1B, (p−1)/(m+p−1); interleaving divides the fill time by v."""
    return (p - 1) / (v * m + p - 1)
