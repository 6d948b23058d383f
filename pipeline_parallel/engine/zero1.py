"""ZeRO stage 1 over the pipeline's data axis: each replica keeps the fp32 master and the optimizer
state of 1/dp of its stage's parameters, optionally in host memory ("offload_optimizer": cpu).

    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    python -m pytest -q tests/test_pipeline_zero1.py

The stage's trainable parameters, flattened and padded to a multiple of dp: replica r owns
[r·S, (r+1)·S), S = padded / dp (sharding.py's rule, one unit). Per step, as DeepSpeed's stage 1:
reduce_grads reduce-scatters the flat gradients over dp in their dtype (then ÷ dp); step takes the
norm from the owned slices (each element counted once over dp, pp, tp), unscales and clips into the
fp32 shard, steps, and all-gathers the updated shards cast to the parameters' dtype.
Traffic per rank and step: (dp−1)/dp·Ψ_pad·(g + w) bytes (g / w = bytes per gradient / parameter
element), what DDP's all-reduce moves. Held: K·Ψ_s/dp optimizer state + 4Ψ_s/dp master + a gradient
shard. With offload the shard, its gradient and the optimizer live on the CPU, every collective
buffer on the stage's device; the result equals the run without offload.
"""
from __future__ import annotations

import torch

from pipeline_parallel.engine.config import build_optimizer
from zero_from_scratch.engine.mpu import counts_on


class Zero1:
    def __init__(self, engine, offload: bool):
        e = self.e = engine
        self.params, self.dp, self.r = engine.params, engine.dp, engine.dp_rank
        self.n = n = sum(p.numel() for p in self.params)
        self.padded = -(-n // self.dp) * self.dp
        self.shard = self.padded // self.dp
        self.lo, self.hi = self.r * self.shard, (self.r + 1) * self.shard
        self.stage_device = engine.device
        self.device = torch.device("cpu") if offload else self.stage_device
        self.dtype = self.params[0].dtype if self.params else torch.float32
        flat = self._flat([p.detach() for p in self.params], torch.float32)
        self.master = flat[self.lo:self.hi].clone().to(self.device)
        self.optimizer = build_optimizer(e.cfg, [self.master], None, e.rank)
        self.grad = None              # this replica's slice of the dp-averaged gradients (stage dtype)
        counted = [torch.full((p.numel(),), float(not e.tied.is_replica(p) and counts_on(p, e.tp_rank)),
                              dtype=torch.float64, device=self.stage_device) for p in self.params]
        self.counted = self._flat(counted, torch.float64)[self.lo:self.hi]   # 1: enters the norm here

    def _flat(self, tensors, dtype) -> torch.Tensor:
        pad = torch.zeros(self.padded - self.n, dtype=dtype, device=self.stage_device)
        return torch.cat([t.reshape(-1).to(device=self.stage_device, dtype=dtype) for t in tensors] + [pad])

    def reduce_grads(self) -> None:
        """Reduce-scatter the stage's gradients over dp: keep the averaged owned slice, drop the rest."""
        flat = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params], self.dtype)
        for p in self.params:
            p.grad = None
        self.grad = torch.empty(self.shard, dtype=self.dtype, device=self.stage_device)
        if self.dp > 1:
            self.e.dp_comm.reduce_scatter_single(self.grad, flat, "sum")
            self.grad.div_(self.dp)
        else:
            self.grad.copy_(flat)

    def norm_sq(self) -> float:
        """Σ g² over the owned slice, each element counted once (tied replicas and tp-replicated
        parameters weigh 0): summed over dp (and pp, tp) by the step's status all-reduce."""
        if self.grad is None:
            return 0.0
        return float((self.grad.double().pow(2) * self.counted).sum())

    def step(self, coef: float, scale: float) -> None:
        """Update this replica's shard from its gradient slice × coef / scale, then all-gather the
        shards (in the parameters' dtype) into every parameter."""
        self.master.grad = self.grad.float().to(self.device).mul_(coef / scale)
        self.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        full = torch.empty(self.padded, dtype=self.dtype, device=self.stage_device)
        mine = self.master.to(device=self.stage_device, dtype=self.dtype)
        if self.dp > 1:
            self.e.dp_comm.all_gather_single(full, mine)
        else:
            full.copy_(mine)
        with torch.no_grad():
            for p, part in zip(self.params, full[:self.n].split([p.numel() for p in self.params])):
                p.copy_(part.view_as(p))

    def skip(self) -> None:
        """An overflowing step: drop the gradient slice."""
        self.grad = None

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
