"""The executor: runs one rank's instruction list (pipeline_parallel/schedules) with real tensors.

    (used by engine.train_batch / eval_batch; see pipeline_parallel/engine/pipe_engine.py for the launch commands)

Messages go through primitives' Communicator (isend / irecv on the pipeline group), so the ledger
counts them. Per step and inner boundary: m activations forward and m gradients back, each
b·s·h·4 bytes for an fp32 activation of shape (b, s, h): a rank sends 2·m·A bytes per boundary
it touches (A = activation bytes; one boundary per side, v of them with v virtual stages).
Shapes and dtypes cross each boundary once, in the first step, as a 10-int64 header (control
traffic in the ledger); afterwards the receiver allocates from the cached header.

Sends are posted and waited for only at the end of the step (a send never blocks a schedule);
receives are waited for at once. Every op is timed (time.perf_counter, one clock for all local
processes) for the bubble measurement and the timeline pictures.

Errors never hang the pipeline: an exception on one rank (a layer raising, a data iterator that
runs dry, a stage whose output shape changes) switches that rank to draining — it skips compute,
keeps every send and receive of its schedule (sending zeros of the agreed shape, or a "poisoned"
header if no shape was agreed yet, after which both sides skip that boundary) — so every rank
reaches the end-of-step status all-reduce, where all ranks learn of the error and raise it.
"""
from __future__ import annotations

import contextlib
import time

import torch

from primitives import LEDGER

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
POISON = -1


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


class Executor:
    def __init__(self, engine):
        self.e = engine
        self.meta: dict = {}          # chunk -> (shape, dtype) of the activation it receives / sends

    # ------------------------------------------------------------------ one step
    def run(self, program, inputs, labels, train: bool):
        e = self.e
        self.inputs, self.labels, self.train = inputs, labels, train
        self.x_in, self.y_out, self.loss_sum = {}, {}, 0.0
        self.pending, self.poisoned, self.events = [], set(), []
        self.meter = ActivationMeter(e.params)
        self.sent = {}                         # op kind -> data bytes sent during it (the per-axis ledger)
        for op in program:
            t0, b0 = time.perf_counter(), LEDGER.data.bytes_sent
            if op.kind in ("reduce_tied", "reduce_grads", "step"):
                self._wait_sends()
                getattr(e, op.kind)()          # collectives: every rank calls them, failed or not
            else:
                try:
                    getattr(self, op.kind)(op)
                except Exception as exc:       # drain: keep the schedule's messages, skip the maths
                    e.fail(f"{op}: {type(exc).__name__}: {exc}")
                    if op.kind in ("send_act", "send_grad", "recv_act", "recv_grad"):
                        self._drain_comm(op)
            self.events.append((op.kind, op.mb, op.chunk, t0, time.perf_counter()))
            self.sent[op.kind] = self.sent.get(op.kind, 0) + LEDGER.data.bytes_sent - b0
        self._wait_sends()
        return self.loss_sum

    def _wait_sends(self):
        for req in self.pending:
            req.wait()
        self.pending = []

    # ------------------------------------------------------------------ helpers
    def _g(self, chunk):
        return chunk * self.e.pp + self.e.stage

    def _peer(self, down: bool):
        # a rank of the pipeline group, which is ordered by stage (primitives.mesh): with dp and tp
        # it holds this rank's own (dp, tp) coordinate on every stage, so stage ± 1 is the peer
        return (self.e.stage + (1 if down else -1)) % self.e.pp

    def _header(self, t):
        h = torch.zeros(10, dtype=torch.int64)
        if t is None:
            h[0] = POISON
        else:
            if t.dim() > 8 or t.dtype not in _DTYPES:
                raise ValueError(f"stage output of shape {tuple(t.shape)} / dtype {t.dtype}: a boundary "
                                 f"tensor needs <= 8 dims and one of {_DTYPES}")
            h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
            h[2:2 + t.dim()] = torch.tensor(t.shape)
        return h

    # ------------------------------------------------------------------ the six ops
    def recv_act(self, op):
        c = op.chunk
        if c in self.poisoned:
            return
        if c not in self.meta:
            h = torch.zeros(10, dtype=torch.int64)
            with LEDGER.control_traffic():
                self.e.comm.irecv(h, self._peer(False)).wait()
            if h[0] == POISON:
                self.poisoned.add(c)
                self.e.fail(None)              # upstream failed; its message arrives at the status check
                return
            self.meta[c] = (tuple(h[2:2 + int(h[1])].tolist()), _DTYPES[int(h[0])])
        shape, dtype = self.meta[c]
        buf = torch.empty(shape, dtype=dtype)
        self.e.comm.irecv(buf, self._peer(False)).wait()
        if self.train and buf.is_floating_point():
            buf.requires_grad_(True)
        self.x_in[(op.mb, c)] = buf

    def fwd(self, op):
        e, key = self.e, (op.mb, op.chunk)
        if e.failed_locally():
            return
        g = self._g(op.chunk)
        x = self.inputs[op.mb] if g == 0 else self.x_in[key]
        meter = self.meter.hooks(key) if e.measure_activations else contextlib.nullcontext()
        with torch.set_grad_enabled(self.train), meter:
            y = e.chunks[op.chunk](x)
            if g == e.pp * e.v - 1:
                loss = e.loss_fn(y, self.labels[op.mb])
                self.loss_sum += float(loss.detach())
                y = loss / e.micro_batches if self.train else None
        if not self.train and g != e.pp * e.v - 1:
            y = y.detach()
        self.y_out[key] = y

    def send_act(self, op):
        c = op.chunk
        down_key = ("out", c)
        if c in self.poisoned:
            return
        y = None if self.e.failed_locally() else self.y_out[(op.mb, c)].detach()
        if down_key not in self.meta:
            with LEDGER.control_traffic():
                self.pending.append(self.e.comm.isend(self._header(y), self._peer(True)))
            if y is None:
                self.poisoned.add(c)
                return
            self.meta[down_key] = (tuple(y.shape), y.dtype)
        shape, dtype = self.meta[down_key]
        if y is not None and (tuple(y.shape) != shape or y.dtype != dtype):
            self.e.fail(f"{op}: stage {self.e.stage} output changed from shape {shape} {dtype} (first micro-batch) to "
                        f"{tuple(y.shape)} {y.dtype} at micro-batch {op.mb}; a pipeline boundary needs one shape "
                        "for every micro-batch")
            y = None
        if y is None:
            y = torch.zeros(shape, dtype=dtype)
        self.pending.append(self.e.comm.isend(y.contiguous(), self._peer(True)))

    def recv_grad(self, op):
        c = op.chunk
        if c in self.poisoned:
            return
        shape, dtype = self.meta[("out", c)]
        buf = torch.empty(shape, dtype=dtype)
        self.e.comm.irecv(buf, self._peer(True)).wait()
        self.grad_in = getattr(self, "grad_in", {})
        self.grad_in[(op.mb, c)] = buf

    def bwd(self, op):
        e, key = self.e, (op.mb, op.chunk)
        y = self.y_out.pop(key, None)
        grad = getattr(self, "grad_in", {}).pop(key, None)
        if e.failed_locally():
            return
        if self._g(op.chunk) == e.pp * e.v - 1:
            y.backward()
        else:
            torch.autograd.backward(y, grad)
        self.meter.release(key)

    def send_grad(self, op):
        c = op.chunk
        if c in self.poisoned:
            return
        x = self.x_in.pop((op.mb, c), None)
        shape, dtype = self.meta[c]
        g = x.grad if (x is not None and x.grad is not None and not self.e.failed_locally()) else None
        if g is None:
            g = torch.zeros(shape, dtype=dtype)
        self.pending.append(self.e.comm.isend(g.contiguous(), self._peer(False)))

    def _drain_comm(self, op):
        """A send/recv that raised: keep the peer unblocked where the shapes are known."""
        if op.kind.startswith("send"):
            key = ("out", op.chunk) if op.kind == "send_act" else op.chunk
            if key in self.meta and op.chunk not in self.poisoned:
                shape, dtype = self.meta[key]
                self.pending.append(self.e.comm.isend(torch.zeros(shape, dtype=dtype),
                                                      self._peer(op.kind == "send_act")))
