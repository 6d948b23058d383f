"""The minimal executor: one pipeline rank runs its instruction list with real tensors.

    python -m pytest -q tests/test_pipeline_parity.py -k textbook_executor

picotron's pipeline_parallel.py for any schedule (pipeline_parallel/schedules/): the list gives the
order; each op is a forward or backward of one micro-batch through one model chunk, or a message
to the neighbouring stage over `comm` (isend / irecv, the interface of primitives/comm.py).
Receives are waited for at once; sends only at the end of the step, so a send never blocks.
A boundary's shape crosses once, in the first step, as a 10-int64 header before the tensor.
Cost per step and inner boundary: m activations down and m gradients up, A = b·s·h·4 bytes each
for fp32 (b, s, h): 2·m·A bytes per boundary a rank touches (v per side with v virtual stages).
The loss is divided by m, so the m backward passes sum to the mean loss's gradient.
"""
from __future__ import annotations

import torch

from pipeline_parallel.schedules.instructions import peer

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def shape_header(t: torch.Tensor) -> torch.Tensor:
    """(dtype code, ndim, shape…) as 10 int64s: all a receiver needs to allocate the tensor."""
    if t.dim() > 8 or t.dtype not in DTYPES:
        raise ValueError(f"stage output {tuple(t.shape)} {t.dtype}: a boundary tensor needs <= 8 dims, one of {DTYPES}")
    h = torch.zeros(10, dtype=torch.int64, device=t.device)
    h[0], h[1] = DTYPES.index(t.dtype), t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape, device=t.device)
    return h


def read_header(h: torch.Tensor) -> tuple:
    return tuple(h[2:2 + int(h[1])].tolist()), DTYPES[int(h[0])]


class Executor:
    """One pipeline rank: its model chunks (virtual stages stage, stage + p, …) and the ops."""

    def __init__(self, comm, stage: int, num_stages: int, chunks, loss_fn, micro_batches: int,
                 virtual_stages: int = 1, optimizer=None, device=None):
        """device: where received boundary tensors live (the stage's: cuda under nccl), default cpu."""
        self.comm, self.stage, self.pp, self.v = comm, stage, num_stages, virtual_stages
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.chunks, self.loss_fn, self.micro_batches, self.optimizer = chunks, loss_fn, micro_batches, optimizer
        self.meta: dict = {}          # ("in" | "out", chunk) -> (shape, dtype) agreed in the first step

    def run(self, program, inputs: dict, labels: dict, train: bool = True) -> float:
        """inputs / labels: micro-batch -> tensor (first / last stage). Returns the last stage's loss sum."""
        self.inputs, self.labels, self.train = inputs, labels, train
        self.x_in, self.y_out, self.grad_in, self.pending, self.loss_sum = {}, {}, {}, [], 0.0
        for op in program:
            self.do(op)
        self.wait_sends()
        return self.loss_sum

    def do(self, op):
        getattr(self, op.kind)(op)

    def wait_sends(self):
        for req in self.pending:
            req.wait()
        self.pending = []

    def send_header(self, y, dst):
        self.pending.append(self.comm.isend(shape_header(y), dst))

    def recv_header(self, src) -> torch.Tensor:
        h = torch.zeros(10, dtype=torch.int64, device=self.device)
        self.comm.irecv(h, src).wait()
        return h

    # ---- the six ops of a micro-batch
    def recv_act(self, op):
        src = peer(op, self.stage, self.pp)
        if ("in", op.chunk) not in self.meta:
            self.meta[("in", op.chunk)] = read_header(self.recv_header(src))
        shape, dtype = self.meta[("in", op.chunk)]
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self.comm.irecv(x, src).wait()
        self.x_in[(op.mb, op.chunk)] = x.requires_grad_(self.train and x.is_floating_point())

    def fwd(self, op):
        key, g = (op.mb, op.chunk), op.chunk * self.pp + self.stage          # g: the virtual stage
        x = self.inputs[op.mb] if g == 0 else self.x_in[key]
        with torch.set_grad_enabled(self.train):
            y = self.chunks[op.chunk](x)
            if g == self.pp * self.v - 1:
                loss = self.loss_fn(y, self.labels[op.mb])
                self.loss_sum += float(loss.detach())
                y = loss / self.micro_batches if self.train else None
        self.y_out[key] = y if self.train or y is None else y.detach()

    def send_act(self, op):
        dst, y = peer(op, self.stage, self.pp), self.y_out[(op.mb, op.chunk)].detach()
        if ("out", op.chunk) not in self.meta:
            self.send_header(y, dst)
            self.meta[("out", op.chunk)] = (tuple(y.shape), y.dtype)
        self.pending.append(self.comm.isend(y.contiguous(), dst))

    def recv_grad(self, op):
        shape, dtype = self.meta[("out", op.chunk)]
        g = torch.empty(shape, dtype=dtype, device=self.device)
        self.comm.irecv(g, peer(op, self.stage, self.pp)).wait()
        self.grad_in[(op.mb, op.chunk)] = g

    def bwd(self, op):
        key = (op.mb, op.chunk)
        y, g = self.y_out.pop(key), self.grad_in.pop(key, None)
        torch.autograd.backward(y, g)          # the last stage: y is the loss, g is None

    def send_grad(self, op):
        x = self.x_in.pop((op.mb, op.chunk))
        g = x.grad if x.grad is not None else torch.zeros_like(x)
        self.pending.append(self.comm.isend(g.contiguous(), peer(op, self.stage, self.pp)))

    # ---- once per step. One pipeline without data-parallel replicas or tied weights has nothing
    # to reduce; pipeline_parallel/engine/draining.py adds the gradient all-reduce and tied weights.
    def reduce_tied(self, op):
        self.wait_sends()

    reduce_grads = reduce_tied

    def step(self, op):
        self.wait_sends()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
