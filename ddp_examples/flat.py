"""Chapter 3's idea: one all-reduce over one flat gradient buffer; every .grad is a view into it.

    torchrun --standalone --nproc_per_node 2 ddp_examples/03_flat.py
    mpiexec -n 2 python ddp_examples/03_flat.py --backend mpi

Cost per optimizer step and rank (ring): 2(N−1)/N·Ψ·e bytes (exactly when Ψ divides by N) in
2(N−1) messages, whatever the number of parameter tensors: the latency term is paid once.
No per-step copies: autograd accumulates straight into the buffer, because each parameter's
.grad *is* a slice of it (as torch DDP's gradient_as_bucket_view=True). What remains slow:
communication starts only after the whole backward has finished, so the network idles during
backward and the CPU idles during the all-reduce. Chapter 4 (bucketed.py) overlaps the two,
with one GradBuffer per bucket.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class GradBuffer:
    """One flat tensor holding the gradients of `params`; each param's .grad is a view into it."""

    def __init__(self, params: list):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views, off = [], 0
        for p in params:
            v = self.buffer[off:off + p.numel()].view_as(p)
            if p.grad is not None:
                v.copy_(p.grad)
            p.grad = v
            self.views.append(v)
            off += p.numel()

    def repoint(self, i: int) -> None:
        """Make params[i].grad the view again: zero if it has none (unused on this rank), a copy
        of it if someone replaced it (zero_grad(set_to_none=True))."""
        p, v = self.params[i], self.views[i]
        if p.grad is None:
            v.zero_()
        elif p.grad.data_ptr() != v.data_ptr():
            v.copy_(p.grad)
        p.grad = v


class FlatDataParallel(nn.Module):
    """Wrap `module`; call `sync_gradients()` after the last backward of an optimizer step.

    Keep .grad tensors alive between steps (`zero_grad(set_to_none=False)`); if they were set
    to None, sync_gradients copies the fresh ones into the buffer once and re-points them.
    comm / algorithm: as NaiveDataParallel. One parameter dtype (buckets group by dtype).
    A parameter with no gradient on this rank counts as a zero gradient.
    """

    def __init__(self, module: nn.Module, comm, *, algorithm: str = "ring"):
        super().__init__()
        self.module, self.comm, self.algorithm = module, comm, algorithm
        params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"rank {comm.rank}: FlatDataParallel needs one parameter dtype, got "
                             f"{sorted(map(str, dtypes))}; BucketedDataParallel groups buckets by dtype")
        self.grads = GradBuffer(params)
        self.flat_grad = self.grads.buffer

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        for i in range(len(self.grads.params)):
            self.grads.repoint(i)
        self.comm.all_reduce(self.flat_grad, "avg", algorithm=self.algorithm)
