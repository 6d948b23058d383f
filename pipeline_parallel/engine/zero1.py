"""ZeRO stage 1 over the pipeline's data axis: each replica keeps the fp32 master and the optimizer
state of 1/dp of its stage's parameters, optionally in host memory ("offload_optimizer": cpu).

    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}

The stage's trainable parameters are flattened (in parameters() order) and padded to a multiple of
dp; replica r owns elements [r·S, (r+1)·S), S = padded / dp (zero_from_scratch/sharding.py's rule,
one unit). Per step: gradients are averaged over dp as without ZeRO (all-reduce, engine
reduce_grads), the step reads this replica's slice, unscales and clips it (the coefficient the
engine computed from the global norm), updates its fp32 shard, and one all-gather over dp puts the
updated shards back into every replica's (16-bit or fp32) parameters. Bytes per rank: optimizer
state K·Ψ_s/dp (+ 4Ψ_s/dp master) instead of K·Ψ_s; traffic 2(dp−1)/dp·Ψ_s (all-reduce) +
(dp−1)/dp·Ψ_s (all-gather) elements — DeepSpeed reduce-scatters instead of all-reducing and
saves the first third of that. With offload the shard, its gradient and the optimizer live on
the CPU; the result equals the run without offload (the same arithmetic on the same device type).
"""
from __future__ import annotations

import torch

from pipeline_parallel.engine.optim import build_optimizer


class Zero1:
    def __init__(self, engine, offload: bool):
        e = self.e = engine
        self.params, self.dp, self.r = engine.params, engine.dp, engine.dp_rank
        n = sum(p.numel() for p in self.params)
        self.padded = -(-n // self.dp) * self.dp
        self.shard = self.padded // self.dp
        self.lo, self.hi = self.r * self.shard, (self.r + 1) * self.shard
        self.device = torch.device("cpu") if offload else (self.params[0].device if self.params else torch.device("cpu"))
        flat = self._flat([p.detach() for p in self.params])
        self.master = flat[self.lo:self.hi].clone().to(self.device)
        self.optimizer = build_optimizer(e.cfg, [self.master], None, e.rank)

    def _flat(self, tensors) -> torch.Tensor:
        out = torch.zeros(self.padded, dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
        o = 0
        for t in tensors:
            out[o:o + t.numel()].copy_(t.reshape(-1))
            o += t.numel()
        return out

    def step(self, inv: float) -> None:
        """Update this replica's shard from its slice of the (dp-averaged) gradients × inv, then
        all-gather the shards into every parameter."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.master.grad = self._flat(grads)[self.lo:self.hi].to(self.device).mul_(inv)
        for p in self.params:
            p.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        full = torch.empty(self.padded, dtype=torch.float32, device=self.params[0].device)
        if self.dp > 1:
            self.e.dp_comm.all_gather_single(full, self.master.to(full.device))
        else:
            full.copy_(self.master)
        o = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[o:o + p.numel()].view_as(p))
                o += p.numel()

    def save(self, path: str) -> None:
        torch.save({"optimizer_state_dict": self.optimizer.state_dict(), "fp32_flat_shard": self.master,
                    "partition": (self.lo, self.hi, self.padded, self.dp)}, path)

    def load(self, path: str) -> None:
        sd = torch.load(path, map_location="cpu", weights_only=False)
        if tuple(sd["partition"]) != (self.lo, self.hi, self.padded, self.dp):
            raise ValueError(f"rank {self.e.rank}: {path} holds shard {sd['partition']} (lo, hi, padded, dp), this "
                             f"run needs {(self.lo, self.hi, self.padded, self.dp)}: resume with the same dp and model")
        self.optimizer.load_state_dict(sd["optimizer_state_dict"])
        with torch.no_grad():
            self.master.copy_(sd["fp32_flat_shard"])
