"""Optimizer offload to the host: `"offload_optimizer": {"device": "cpu"}` (DeepSpeed's ZeRO-Offload).

    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    python -m pytest -q tests/test_recipes_offload_cpu.py        (CPU; the CUDA test runs where a GPU is)

Where the states live: the fp32 master of every owned shard (also in fp32 training, where
without offload the parameter shard itself is the master) and Adam's exp_avg / exp_avg_sq, all
on the host; pinned (page-locked) when the model is on a GPU (unless "pin_memory": false), so
the copies are plain DMA and the upward ones asynchronous.
The device keeps only the model-dtype parameters and gradients.

One optimizer step, per unit and per chunk of min(sub_group_size, shard, 2^20) elements:
  gradient shard  device → host   (one host buffer in the model dtype, for the step only)
  × clip_coef / (N · loss_scale), Adam on the host master (optim.py's step_group, the function the
  non-offloaded engine calls, on the same values: offload moves bytes, not maths)
  master chunk    host → device   (cast to the model dtype on the way)
Bytes moved per step and rank, b = bytes per model-dtype element, P = padded Ψ:
  b·P/N down (gradients) + b·P/N up (parameters); counted in `bytes_down` / `bytes_up`.
Memory per rank: device saves K·Ψ/N (K = 12 mixed: master + m + v; 8 in fp32: m + v); the host
holds 12·Ψ/N (4 master + 8 m, v) plus, during the step, one chunk of b bytes per element for
the gradients.
Written device-generic: for a model on the CPU the copies are host → host (same code path, which
is how the CPU test proves the path bit-identical to no offload).
"""
from __future__ import annotations

import torch

STREAM_CHUNK = 1 << 20     # elements per staging buffer, whatever the shard size (4 MiB of fp32)


def stream_chunk(engine, sub_group_size: int) -> int:
    """Elements per staging buffer: min(sub_group_size, largest shard, STREAM_CHUNK), at least 1."""
    return max(1, min(int(sub_group_size), max((u.shard for u in engine.layout.units), default=1), STREAM_CHUNK))


class HostOptimizerStates:
    """fp32 master + Adam m, v of this rank's shards on the host; the step runs there."""

    def __init__(self, engine, sub_group_size: int, pin_memory: bool = True):
        self.e = e = engine
        self.device = e.device
        self.pin = pin_memory and e.device.type == "cuda"   # pinning needs (and only helps) CUDA
        self.chunk = stream_chunk(e, sub_group_size)
        self.master = [self._host(n, torch.float32) for n in e.layout.group_local]
        self.bytes_down = self.bytes_up = 0       # running totals; per step: see report()
        self.steps = 0

    def _host(self, n: int, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device="cpu", pin_memory=self.pin)

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """An Adam state tensor, kept on the host (pinned with a GPU model)."""
        return t.pin_memory() if self.pin else t

    def write_master(self) -> None:
        """host master ← the parameter shards (after init, a weight edit, or an fp32 load)."""
        e = self.e
        for u in e.layout.units:
            self.master[u.group][u.local_offset:u.local_offset + u.shard].copy_(e.stage.param_shard(u))

    def after_load(self) -> None:
        # mixed: checkpoint.load wrote the master itself (engine.master is ours, more precise than
        # the bf16 params); fp32: the params were loaded, the host copy must follow them
        if not self.e.mixed:
            self.write_master()

    def step(self, coef: float, scale: float) -> None:
        e, opt, first = self.e, self.e.optimizer, set()
        gbuf = self._host(self.chunk, e.dtype)    # freed when the step returns
        for u in e.layout.units:
            g_dev, p_dev = e.stage.grad_shard(u), e.stage.param_shard(u)
            master = self.master[u.group][u.local_offset:u.local_offset + u.shard]
            for a in range(0, max(u.shard, 1), self.chunk):
                b = min(a + self.chunk, u.shard)
                g = gbuf[:b - a]
                g.copy_(g_dev[a:b])                # device → host; blocking: Adam reads it next
                g32 = g.mul_(coef / scale) if not e.mixed else g.float().mul_(coef / scale)
                opt.step_group(u.group, master[a:b], g32, u.local_offset + a, u.local_offset + b,
                               count=u.group not in first)
                first.add(u.group)
                # host → device; from pinned memory it is asynchronous and overlaps the next chunk
                p_dev[a:b].copy_(master[a:b], non_blocking=self.pin)
                self.bytes_down += g.numel() * g.element_size()
                self.bytes_up += (b - a) * p_dev.element_size()
        if self.pin:                               # the params are read next: the copies must land
            torch.cuda.current_stream(self.device).synchronize()
        self.steps += 1

    def report(self) -> dict:
        """Bytes moved per optimizer step on this rank (mean over the steps run) and host bytes held."""
        n = max(self.steps, 1)
        held = sum(t.numel() * t.element_size() for t in self.master)
        held += sum(s[k].numel() * s[k].element_size() for s in self.e.optimizer.state for k in ("exp_avg", "exp_avg_sq"))
        return {"device": "cpu", "bytes_down_per_step": self.bytes_down // n, "bytes_up_per_step": self.bytes_up // n,
                "host_state_bytes": held, "pinned": self.pin}

    def close(self) -> None:
        pass
