"""Chapter 2's idea: after backward, average every parameter's gradient, one all-reduce each.

    torchrun --standalone --nproc_per_node 2 ddp_examples/02_naive.py
    mpiexec -n 2 python ddp_examples/02_naive.py --backend mpi

Cost per optimizer step and rank (ring): Σ_p 2(N−1)/N·|p|·e = 2(N−1)/N·Ψ·e bytes, but in
2(N−1)·(number of parameters) messages, so a model with many small tensors pays the per-message
latency α many times. Chapter 3 (flat.py) fixes that with one buffer.

The main seed's version looked like this and never averaged anything:

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

import primitives as P
from ddp_examples.engine.state import sync_initial_state


class NaiveDataParallel(nn.Module):
    """Wrap `module`; call `sync_gradients()` after the last backward of an optimizer step.

    algorithm: the primitives all-reduce algorithm (default "ring", whose bytes match the
    2(N−1)/N·Ψ·e formula; "auto" may pick recursive doubling for small tensors, which sends more).
    init_sync: "broadcast" (rank 0's parameters and buffers are copied to all ranks at
    construction), "check" (raise if they differ) or "none".
    A parameter with no gradient on this rank counts as a zero gradient (it must still take part
    in the all-reduce, or the ranks' calls would no longer line up).
    """

    def __init__(self, module: nn.Module, group=None, *, algorithm: str = "ring", init_sync: str = "broadcast"):
        super().__init__()
        self.module, self.group, self.algorithm = module, group, algorithm
        self.comm = P.get_comm(group)
        sync_initial_state(module, self.comm, init_sync, type(self).__name__, group)
        self._params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        n = self.comm.size
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            P.all_reduce(p.grad, P.ReduceOp.SUM, self.group, algorithm=self.algorithm)
            p.grad.div_(n)
