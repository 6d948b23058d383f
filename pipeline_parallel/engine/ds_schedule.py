"""`deepspeed.runtime.pipe.schedule`: ringzero's 1F1B order laid on DeepSpeed's lockstep clock.

    python -c "from pipeline_parallel.engine.ds_schedule import TrainSchedule as T; print(list(T(3, 2, 0)))"

DeepSpeed's schedules are generators of steps, each a list of PipeInstructions, such that a barrier
between two steps cannot deadlock. TrainSchedule puts each compute op of ringzero's 1F1B
(schedules/one_f_one_b.py) on DeepSpeed's clock: stage s runs forward b at step 2b + s and backward
b at step 2b + 2p − 1 − s, over 2(m + p − 1) steps; around it the receive of its input, the send of
the previous step's result, LoadMicroBatch on the first and last stage, and the reductions and
OptimizerStep in the last step; buffers reused cyclically. InferenceSchedule: forward b at step
b + s, two buffers alternating, send/receive order by the stage's parity. All as DeepSpeed 0.19.8's
runtime/pipe/schedule.py (its test_pipe_schedule.py runs against this file in tests/ds_bulk).
Cost: O(m + p) small objects per batch.
"""
from __future__ import annotations

from pipeline_parallel.schedules.one_f_one_b import one_f_one_b
from zero_from_scratch.as_deepspeed.utils import call_to_str

__all__ = ["PipeSchedule", "InferenceSchedule", "TrainSchedule", "DataParallelSchedule", "PipeInstruction",
           "OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "BufferOpInstruction", "LoadMicroBatch", "ForwardPass",
           "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P"]


class PipeInstruction:
    """One instruction; its keyword arguments become attributes (DeepSpeed's engine dispatches on the type)."""

    def __init__(self, **kwargs):
        self.name = self.__class__.__name__
        self.kwargs = kwargs
        for key, val in kwargs.items():
            setattr(self, key, val)

    def __repr__(self):
        return call_to_str(self.name, **self.kwargs)


class OptimizerStep(PipeInstruction):
    pass


class ReduceGrads(PipeInstruction):
    pass


class ReduceTiedGrads(PipeInstruction):
    pass


class CommitP2P(PipeInstruction):
    pass


class BufferOpInstruction(PipeInstruction):
    def __init__(self, buffer_id, **kwargs):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    pass


class ForwardPass(BufferOpInstruction):
    pass


class BackwardPass(BufferOpInstruction):
    pass


class SendActivation(BufferOpInstruction):
    pass


class RecvActivation(BufferOpInstruction):
    pass


class SendGrad(BufferOpInstruction):
    pass


class RecvGrad(BufferOpInstruction):
    pass


class PipeSchedule:
    """Iterating yields the steps; subclasses define steps() and num_pipe_buffers()."""

    def __init__(self, micro_batches, stages, stage_id):
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.prev_stage, self.next_stage = stage_id - 1, stage_id + 1

    def steps(self):   # abstract, as in DeepSpeed: TrainSchedule / InferenceSchedule define it
        raise NotImplementedError(f"{type(self).__name__}.steps(): a PipeSchedule subclass defines its steps "
                                  "(TrainSchedule, InferenceSchedule)")

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _valid_micro_batch(self, b) -> bool:
        return 0 <= b < self.micro_batches

    def _valid_stage(self, s) -> bool:
        return 0 <= s < self.stages

    stage = property(lambda self: self.stage_id)
    num_stages = property(lambda self: self.stages)
    num_micro_batches = property(lambda self: self.micro_batches)
    is_first_stage = property(lambda self: self.stage_id == 0)
    is_last_stage = property(lambda self: self.stage_id == self.stages - 1)

    def _buffer_idx(self, b) -> int:
        assert self._valid_micro_batch(b)
        return b % self.num_pipe_buffers()

    def __iter__(self):
        self.it = None
        return self

    def __next__(self):
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    def steps(self):
        even = self.stage_id % 2 == 0
        for t in range(self.micro_batches + self.stages - 1):
            b = t - self.stage_id
            recv_buf, send_buf = (t % 2, (t + 1) % 2) if even else ((t + 1) % 2, t % 2)
            cmds = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(b):
                cmds.append(LoadMicroBatch(recv_buf))
            send = [SendActivation(send_buf)] if self._valid_stage(self.next_stage) and self._valid_micro_batch(b - 1) \
                else []
            recv = [RecvActivation(recv_buf)] if self._valid_stage(self.prev_stage) and self._valid_micro_batch(b) else []
            cmds += send + recv if even else recv + send
            if self._valid_micro_batch(b):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    def _clock(self) -> dict:
        """step → (micro-batch, is_forward): ringzero's 1F1B compute order, each op at its clock step."""
        p, s, at, last = self.stages, self.stage_id, {}, -1
        for op in one_f_one_b(s, p, self.micro_batches):
            if op.kind in ("fwd", "bwd"):
                t = 2 * op.mb + s if op.kind == "fwd" else 2 * op.mb + 2 * p - 1 - s
                assert t > last, "1F1B's order must fit the clock"
                at[t], last = (op.mb, op.kind == "fwd"), t
        return at

    def steps(self):
        at, total, prev = self._clock(), 2 * (self.micro_batches + self.stages - 1), -1
        for t in range(total):
            # an idle step keeps the parity's direction; its micro-batch is out of range
            b, fwd = at.get(t, (-1, (t - self.stage_id) % 2 == 0))
            cmds = []
            if fwd:
                if self._valid_micro_batch(prev) and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(self._buffer_idx(prev)))
                if self._valid_micro_batch(b) and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(self._buffer_idx(b)))
            else:
                if self._valid_micro_batch(b) and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(self._buffer_idx(b)))
                if self._valid_micro_batch(prev) and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(self._buffer_idx(prev)))
            if (self.is_first_stage or self.is_last_stage) and fwd and self._valid_micro_batch(b):
                cmds.append(LoadMicroBatch(self._buffer_idx(b)))
            if self._valid_micro_batch(b):
                cmds.append((ForwardPass if fwd else BackwardPass)(self._buffer_idx(b)))
            if t == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev = b
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The most forwards in flight: the stages from here to the last (at least 2)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """One stage: load, forward, backward per micro-batch; reduce and step after the last."""

    def steps(self):
        for t in range(self.micro_batches):
            cmds = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0), BackwardPass(buffer_id=0)]
            if t == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
