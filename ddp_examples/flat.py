"""Chapter 3's idea: one all-reduce over one flat gradient buffer; every .grad is a view into it.

    torchrun --standalone --nproc_per_node 2 ddp_examples/03_flat.py
    mpiexec -n 2 python ddp_examples/03_flat.py --backend mpi

Cost per optimizer step and rank (ring): 2(N−1)/N·Ψ·e bytes (exactly when Ψ divides by N) in
2(N−1) messages, whatever the number of parameter tensors: the latency term is paid once.
No per-step copies: autograd accumulates straight into the buffer, because each parameter's
.grad *is* a slice of it (as torch DDP's gradient_as_bucket_view=True). What remains slow:
communication starts only after the whole backward has finished, so the network idles during
backward and the CPU idles during the all-reduce. Chapter 4 (bucketed.py) overlaps the two.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import primitives as P
from ddp_examples.engine.state import module_device, sync_initial_state


class FlatDataParallel(nn.Module):
    """Wrap `module`; call `sync_gradients()` after the last backward of an optimizer step.

    Keep .grad tensors alive between steps (`zero_grad(set_to_none=False)`); if they were set
    to None, sync_gradients copies the fresh ones into the buffer once and re-points them.
    algorithm / init_sync: as NaiveDataParallel (default "ring": bytes match the formula).
    A parameter with no gradient on this rank counts as a zero gradient.
    """

    def __init__(self, module: nn.Module, group=None, *, algorithm: str = "ring", init_sync: str = "broadcast"):
        super().__init__()
        self.module, self.group, self.algorithm = module, group, algorithm
        self.comm = P.get_comm(group)
        sync_initial_state(module, self.comm, init_sync, type(self).__name__, group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) > 1:
            raise ValueError(f"rank {self.comm.rank}: FlatDataParallel needs one parameter dtype, got "
                             f"{sorted(map(str, dtypes))}; BucketedDataParallel groups buckets by dtype")
        dtype = dtypes.pop() if dtypes else torch.float32
        self.flat_grad = torch.zeros(sum(p.numel() for p in self._params), dtype=dtype,
                                     device=module_device(module, self.comm, type(self).__name__))
        self._views, off = [], 0
        for p in self._params:
            v = self.flat_grad[off:off + p.numel()].view_as(p)
            if p.grad is not None:
                v.copy_(p.grad)
            p.grad = v
            self._views.append(v)
            off += p.numel()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        for p, v in zip(self._params, self._views):
            if p.grad is None:                       # unused on this rank: contributes zero
                v.zero_()
                p.grad = v
            elif p.grad.data_ptr() != v.data_ptr():  # someone replaced .grad (set_to_none)
                v.copy_(p.grad)
                p.grad = v
        P.all_reduce(self.flat_grad, P.ReduceOp.SUM, self.group, algorithm=self.algorithm)
        self.flat_grad.div_(self.comm.size)
