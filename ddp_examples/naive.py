"""Chapter 2's idea: after backward, average every parameter's gradient, one all-reduce each.

    torchrun --standalone --nproc_per_node 2 ddp_examples/02_naive.py
    mpiexec -n 2 python ddp_examples/02_naive.py --backend mpi

Cost per optimizer step and rank (ring): Σ_p 2(N−1)/N·|p|·e = 2(N−1)/N·Ψ·e bytes, but in
2(N−1)·(number of parameters) messages, so a model with many small tensors pays the per-message
latency α many times. Chapter 3 (flat.py) fixes that with one buffer.

A version that selects parameters by type never averages anything:

    for param in model.parameters():
        if type(param) is torch.Tensor:          # False: an nn.Parameter is a *subclass*
            dist.all_reduce(param.grad.data)
            param.grad.data /= world_size

`type(param) is torch.Tensor` is False for every nn.Parameter, so the loop body never runs and
every rank silently trains on its own shard of the data. Nothing crashes; the loss even goes
down. The only symptom is that the ranks' parameters drift apart, which is what
tests/test_ddp.py checks after every run (and what max |param − rank 0 param| in the table shows).
We select parameters by `requires_grad`, never by type.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class NaiveDataParallel(nn.Module):
    """Wrap `module`; call `sync_gradients()` after the last backward of an optimizer step.

    comm: the data-parallel communicator (its all_reduce method). algorithm: its all-reduce
    algorithm (default "ring", whose bytes match the 2(N−1)/N·Ψ·e formula). Every rank must
    start from the same parameters (ddp_examples/engine/state.py broadcasts them).
    A parameter with no gradient on this rank counts as a zero gradient (it must still take part
    in the all-reduce, or the ranks' calls would no longer line up).
    """

    def __init__(self, module: nn.Module, comm, *, algorithm: str = "ring"):
        super().__init__()
        self.module, self.comm, self.algorithm = module, comm, algorithm
        self._params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad, "avg", algorithm=self.algorithm)
