"""engine.optimizer.accumulated_grads_in_cpu (DeepSpeed's stage_1_and_2.py with offload_optimizer), as a view.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json   (ZeRO-1/2 + offload_optimizer)
    norm = sum(g.float().norm() ** 2 for g in engine.optimizer.accumulated_grads_in_cpu.values()) ** 0.5

DeepSpeed, ZeRO-1/2 with offload_optimizer, keeps in host memory, per parameter in this rank's
partition (key: DeepSpeed's param_id, the parameter's index over the optimizer's groups in order), a
buffer of the parameter's numel and dtype holding its reduced (rank-averaged) gradient summed over the
backwards since the last step. It fills it (async_accumulate_grad_in_cpu_via_gpu) only where a step
has more than one backward: at stage 2 from the first backward that is not the step's lone boundary
one (its gradients are reduced at every backward), at stage 1 at the boundary backward when it is not
the step's first (they are reduced only there); a step of one backward allocates nothing. Its entries
stay after the step. With bf16 and data_types.grad_accum_dtype fp32 (its compact fp32 gradient
partition, _use_compact_grad_partition_buffer) copy_grads_in_partition returns before any of this: the
dict exists and stays empty, and so does the one here.

Here ringzero's own shards already hold that sum (the offloaded optimizer reads them at the step), so
the view copies out of them when read: key → a CPU tensor of the parameter's numel and dtype, this
rank's part of the parameter the reduced sum ÷ the ranks (× the fp16 loss scale, as DeepSpeed's), the
rest 0 (DeepSpeed's holds this rank's unreduced values there: no rank's gradient). The keys appear as
DeepSpeed's would, counted by engine.backward (a plain loss.backward() is not counted), every parameter
of the partition at once (DeepSpeed lists one when its gradient first arrives). Read after the step,
the values are 0 where DeepSpeed's still hold the last step's sums; at stage 1 between boundaries they
are this rank's own unreduced sum.
Cost: nothing until read; a read copies this rank's part of each listed parameter to the host.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from zero_from_scratch.engine.precision import grad_dtype, model_dtype


class AccumulatedGradsInCpu(Mapping):
    """param_id → the parameter's accumulated reduced gradient, flat, on the host (see the module docstring)."""

    def __init__(self, engine):
        self.engine, self.filled, self._since_step, self._steps = engine, False, 0, engine.global_steps
        owner = engine.stage.owner()
        self.slots = {}     # param_id → (unit, slot, [a, b) this rank's part in unit coordinates)
        pid = 0
        for names in engine.group_names:
            for name in names:
                ui, slot = engine.layout.where[name]
                u = engine.layout.units[ui]
                lo, hi = u.shard_range(owner)
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    self.slots[pid] = (u, slot, a, b, name)
                pid += 1

    def after_backward(self, boundary: bool) -> None:
        """DeepSpeed's condition for copying the gradients to its host buffers (copy_grads_in_partition)."""
        if self.engine.global_steps != self._steps:
            self._steps, self._since_step = self.engine.global_steps, 0
        k = self._since_step                  # DeepSpeed's micro_step_id during this backward
        self._since_step += 1
        if (k > 0 and boundary) or (self.engine.stage_id == 2 and not boundary):
            self.filled = True

    def __getitem__(self, pid):
        if not self.filled or pid not in self.slots:
            raise KeyError(pid)
        e = self.engine
        u, slot, a, b, name = self.slots[pid]
        lo = u.shard_range(e.stage.owner())[0]
        if e._grads_local:                     # stage 1 between boundaries: nothing reduced yet
            part = e.local_grad(name).reshape(-1)[a - slot.offset:b - slot.offset]
        else:
            part = e.stage.grad_shard(u)[a - lo:b - lo].float() / e.config.reduction.post_divisor
        dtype = e.params_by_name[name].dtype
        out = torch.zeros(slot.numel, dtype=dtype, device="cpu")
        out[a - slot.offset:b - slot.offset] = part.to(device="cpu", dtype=dtype)
        return out

    def __iter__(self):
        return iter(self.slots if self.filled else ())

    def __len__(self) -> int:
        return len(self.slots) if self.filled else 0

    def __repr__(self) -> str:
        return f"AccumulatedGradsInCpu({len(self)} parameters)"


def install(engine) -> None:
    """On a ZeRO-1/2 engine with offload_optimizer: the view on engine.optimizer, and engine.backward
    telling it each backward (DeepSpeed's buffers are filled inside its backward)."""
    if engine.stage_id not in (1, 2) or engine.config.offload_optimizer is None:
        return
    engine.optimizer.__dict__.get("refused_names", {}).pop("accumulated_grads_in_cpu", None)
    if grad_dtype(engine.config, engine.stage_id) == torch.float32 != model_dtype(engine.config):
        engine.optimizer.accumulated_grads_in_cpu = {}       # DeepSpeed's compact partition: never filled
        return
    view = AccumulatedGradsInCpu(engine)
    engine.optimizer.accumulated_grads_in_cpu = view
    backward = engine.backward

    def counted_backward(loss, *args, **kwargs):
        boundary = engine.backward_boundary()
        out = backward(loss, *args, **kwargs)
        view.after_backward(boundary)
        return out

    engine.backward = counted_backward
