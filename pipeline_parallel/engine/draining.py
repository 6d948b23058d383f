"""The engine's executor: the textbook Executor (pipeline_parallel/executor.py) plus what keeps a
pipeline of many processes safe and measured; every override calls the textbook op.

    (used by PipelineEngine.train_batch / eval_batch; launch commands in pipeline_parallel/engine/pipe_engine.py)

  * dynamic_shape (PipelineModule's) — a shape header before every activation, as DeepSpeed re-sends
    its meta every micro-batch; a gradient is received in the shape its micro-batch sent;
  * draining — an exception on one rank (a layer raising, a data iterator running dry, an output
    shape changing) switches it to draining: it skips compute but keeps every send and receive
    (zeros of the agreed shape, or a "poisoned" header before any shape was agreed, after which both
    sides skip that boundary), so every rank reaches the status all-reduce and raises. Never a hang.
  * the end-of-step ops delegate to the engine (reduce_tied / reduce_grads / step);
  * timing — every op timed with time.perf_counter (measure_bubbles, figures/ch09_pipeline.py);
  * the ledger — shape headers are control traffic; data bytes are summed per op kind;
  * ActivationMeter — bytes autograd saves for backward, per (micro-batch, chunk);
  * every buffer it allocates on the stage's device.
"""
from __future__ import annotations

import contextlib
import time

import torch

from pipeline_parallel.executor import Executor
from pipeline_parallel.schedules.instructions import FINAL, SENDS, peer
from primitives import LEDGER

POISON = -1


class Poisoned(Exception):
    """The upstream stage failed before this boundary's shape was agreed."""


class ActivationMeter:
    """Bytes autograd keeps for backward per (micro-batch, chunk), excluding parameters: the live
    total rises with each forward, falls with each backward; `peak` is the schedule's cost."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live, self.peak, self.per = 0, 0, {}
        self._key = None

    def hooks(self, key):
        self._key = key
        self.per.setdefault(key, 0)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        if t.untyped_storage().data_ptr() not in self.param_storages:
            n = t.numel() * t.element_size()
            self.per[self._key] += n
            self.live += n
            self.peak = max(self.peak, self.live)
        return t

    def release(self, key):
        self.live -= self.per.pop(key, 0)


def measure_bubbles(events_per_rank):
    """(bubble per rank, span, t0) of one step from every rank's `events` (one perf_counter clock):
    busy = forward + backward time, span = first instruction on any rank → last compute on any."""
    t0 = min(e[3] for ev in events_per_rank for e in ev)
    t1 = max(e[4] for ev in events_per_rank for e in ev if e[0] in ("fwd", "bwd"))
    busy = [sum(e[4] - e[3] for e in ev if e[0] in ("fwd", "bwd")) for ev in events_per_rank]
    return [1 - b / (t1 - t0) for b in busy], t1 - t0, t0


class DrainingExecutor(Executor):
    def __init__(self, engine):
        super().__init__(engine.comm, engine.stage, engine.pp, engine.chunks, engine.loss_fn, engine.micro_batches,
                         engine.v, device=engine.device)
        self.e = engine
        self.dynamic = getattr(engine.module, "dynamic_shape", False)

    def run(self, program, inputs, labels, train: bool = True):
        self.poisoned, self.events, self.sent = set(), [], {}   # sent: op kind -> data bytes (the per-axis ledger)
        self.in_shapes = {}                    # dynamic_shape: (mb, chunk) -> the shape that micro-batch received
        self.meter = ActivationMeter(self.e.params)
        return super().run(program, inputs, labels, train)

    def do(self, op):
        t0, b0 = time.perf_counter(), LEDGER.data.bytes_sent
        if op.kind in FINAL:
            super().do(op)                     # collectives: every rank calls them, failed or not
        else:
            try:
                super().do(op)
            except Exception as exc:           # drain: keep the schedule's messages, skip the maths
                self.e.fail(f"{op}: {type(exc).__name__}: {exc}")
                if op.kind in SENDS:
                    self._drain_send(op)
        self.events.append((op.kind, op.mb, op.chunk, t0, time.perf_counter()))
        self.sent[op.kind] = self.sent.get(op.kind, 0) + LEDGER.data.bytes_sent - b0

    # ---- the textbook ops, guarded
    def send_header(self, y, dst):
        with LEDGER.control_traffic():
            super().send_header(y, dst)

    def recv_header(self, src):
        with LEDGER.control_traffic():
            h = super().recv_header(src)
        if h[0] == POISON:
            raise Poisoned
        return h

    def recv_act(self, op):
        if op.chunk in self.poisoned:
            return
        if self.dynamic:                       # DeepSpeed's dynamic_shape: a header before every activation
            self.meta.pop(("in", op.chunk), None)
        try:
            super().recv_act(op)
        except Poisoned:
            self.poisoned.add(op.chunk)
            self.e.fail(None)                  # upstream failed; its message arrives at the status check
            return
        if self.dynamic and ("in", op.chunk) in self.meta:
            self.in_shapes[(op.mb, op.chunk)] = self.meta[("in", op.chunk)]

    def fwd(self, op):
        if self.e.failed_locally():
            return
        with self.meter.hooks((op.mb, op.chunk)) if self.e.measure_activations else contextlib.nullcontext():
            super().fwd(op)
        key = (op.mb, op.chunk)
        if self.train and op.chunk * self.pp + self.stage == self.pp * self.v - 1 and self.e.loss_scale != 1.0:
            self.y_out[key] = self.y_out[key] * self.e.loss_scale     # fp16: backward from S·loss (engine/step.py)

    def send_act(self, op):
        c, key = op.chunk, (op.mb, op.chunk)
        if c in self.poisoned:
            return
        y = None if self.e.failed_locally() else self.y_out[key]
        if self.dynamic and y is not None:
            self.meta.pop(("out", c), None)    # this micro-batch's shape goes first
        agreed = self.meta.get(("out", c))
        if agreed is None and y is None:       # failed before any shape crossed: poison the boundary
            self._poison(op)
            return
        if y is not None and agreed is not None and (tuple(y.shape), y.dtype) != agreed:
            self.e.fail(f"{op}: stage {self.stage} output changed from shape {agreed[0]} {agreed[1]} (first "
                        f"micro-batch) to {tuple(y.shape)} {y.dtype} at micro-batch {op.mb}; a pipeline boundary "
                        "needs one shape for every micro-batch")
            y = None
        if y is None:
            self.y_out[key] = torch.zeros(agreed[0], dtype=agreed[1], device=self.device)
            if self.dynamic:                   # the peer reads a header before every activation
                self.meta.pop(("out", c), None)
        super().send_act(op)

    def recv_grad(self, op):
        key = (op.mb, op.chunk)
        if self.dynamic and self.y_out.get(key) is not None:    # the shape this micro-batch sent
            self.meta[("out", op.chunk)] = (tuple(self.y_out[key].shape), self.y_out[key].dtype)
        if op.chunk not in self.poisoned:
            super().recv_grad(op)

    def bwd(self, op):
        key = (op.mb, op.chunk)
        if self.e.failed_locally():
            self.y_out.pop(key, None)
            self.grad_in.pop(key, None)
            return
        super().bwd(op)
        self.meter.release(key)

    def send_grad(self, op):
        c, key = op.chunk, (op.mb, op.chunk)
        if c in self.poisoned:
            return
        if self.e.failed_locally() or key not in self.x_in:   # zeros in the shape this micro-batch came in
            shape, dtype = self.in_shapes.get(key) or self.meta[("in", c)]
            self.x_in[key] = torch.zeros(shape, dtype=dtype, device=self.device)    # no .grad: zeros are sent
        super().send_grad(op)
        self.in_shapes.pop(key, None)

    def _drain_send(self, op):
        """A send that raised: keep the peer unblocked where the shape is known."""
        if op.chunk in self.poisoned:
            return
        key = ("out", op.chunk) if op.kind == "send_act" else ("in", op.chunk)
        shape_in = self.in_shapes.pop((op.mb, op.chunk), None) if op.kind != "send_act" else None
        if shape_in or key in self.meta:
            shape, dtype = shape_in or self.meta[key]
            self.pending.append(self.comm.isend(torch.zeros(shape, dtype=dtype, device=self.device), peer(op, self.stage, self.pp)))

    def _poison(self, op):
        """Tell the next stage this boundary carries nothing more this step (it raises Poisoned there)."""
        h = torch.zeros(10, dtype=torch.int64, device=self.device)
        h[0] = POISON
        with LEDGER.control_traffic():
            self.pending.append(self.comm.isend(h, peer(op, self.stage, self.pp)))
        self.poisoned.add(op.chunk)

    # ---- once per step: the engine's collectives, after the sends are done
    def reduce_tied(self, op):
        super().reduce_tied(op)
        self.e.tied.reduce_grads()

    def reduce_grads(self, op):
        super().reduce_grads(op)
        self.e.reduce_grads()

    def step(self, op):
        super().step(op)                       # no optimizer here: the engine's step clips and steps
        self.e.step()
