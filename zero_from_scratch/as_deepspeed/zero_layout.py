"""DeepSpeed's ZeRO-optimizer layout that its tests and some scripts read, as live views of ringzero's buffers.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    (quirks.expose_torch_optimizer installs it on engine.optimizer after initialize)

In bf16/fp16 at stages 1-3 DeepSpeed's inner torch optimizer steps one flat fp32 partition per group
(stages 1-2: single_partition_of_fp32_groups, stage_1_and_2.py; stage 3: fp32_partitioned_groups_flat,
one per sub-group, stage3.py) and writes it into the group: under the runner
  engine.optimizer.optimizer.param_groups[g]["params"] == [group g's fp32 partition]
  engine.optimizer.optimizer.state[partition]        the group's {"step", "exp_avg", "exp_avg_sq"}
  engine.optimizer.fp16_groups[g]                    the model's parameters of group g
  engine.optimizer.fp32_partitioned_groups_flat[g]   group g's fp32 partition
  engine.optimizer.single_partition_of_fp32_groups[g]   the same, by its stage 1-2 name
  engine.optimizer.parameter_offload.forward_hooks / backward_hooks   stage 3's module hooks (torch handles)
ringzero's partition of group g is engine.master[g], this rank's fp32 master, the same numbers (in
fp32 at stage 3 the rank's flat parameter shard of the group, which its optimizer steps); its
sub-groups are its param groups (sub_group_size only paces DeepSpeed's offload). Every name reads
the engine when it is read: nothing is copied, nothing goes stale. In fp32 at stages 1-2 ringzero
keeps no fp32 partition apart from the parameters (each unit's shard is a slice of the parameters'
flat buffer), and with nvme offload the master lives in files: there the names raise
NotServedAttributeError (an AttributeError) saying so.
Cost: none until read; a lookup over the groups per state[partition].
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zero_from_scratch.as_deepspeed import more_layout
from zero_from_scratch.as_deepspeed.finder import NotServedAttributeError, message

NAME = "engine.optimizer's flat fp32 partitions (fp32_partitioned_groups_flat, state keyed by them)"
FP32 = message(NAME + " in fp32", "step a flat fp32 copy of each group's partition (ringzero steps the parameters' "
               "own flat buffer at stages 1-2 in fp32, one slice per unit)", "engine.optimizer.state[g], safe_get_full_optimizer_state")
NVME = message(NAME + " with offload_optimizer nvme", "hold them in memory (ringzero's fp32 master lives in files)",
               "safe_get_full_fp32_param, safe_get_full_optimizer_state")


def partitions(engine) -> list:
    """Group g's fp32 partition (engine.master[g]), or NotServedAttributeError with the reason."""
    if not engine.mixed:
        if engine.stage_id == 3 and getattr(engine.config, "offload_param", None) is None:
            return engine.stage.pshard     # ZeRO-3 in fp32: the rank's parameter shards are the partition
        raise NotServedAttributeError(FP32)
    if engine.offload is not None and not hasattr(engine.offload, "adopt"):
        raise NotServedAttributeError(NVME)
    return engine.master


class Live(Sequence):
    """A read-only sequence computed from the engine at every access."""

    def __init__(self, get):
        self._get = get

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self):
        return iter(self._get())

    def __repr__(self) -> str:
        return f"Live({list(self._get())!r})"


class StateByPartition(Mapping):
    """The inner optimizer's `state` as DeepSpeed keys it (by each group's fp32 partition); the
    group index still works. Values are the sharded optimizer's own dicts."""

    def __init__(self, engine):
        self.engine = engine

    def _keys(self) -> list:
        try:
            return list(partitions(self.engine))
        except AttributeError:
            return list(range(len(self.engine.optimizer.state)))

    def __getitem__(self, key):
        st = self.engine.optimizer.state
        if torch.is_tensor(key):
            for g, t in enumerate(partitions(self.engine)):
                if t is key:
                    return st[g]
            raise KeyError(f"tensor of shape {tuple(key.shape)} is no group's fp32 partition")
        return st[key]

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self.engine.optimizer.state)


BIT16 = message("engine.optimizer.parallel_partitioned_bit16_groups / nccl_start_alignment_factor",
                "hand out each rank's partition of a group as one contiguous view, aligned for NCCL",
                "ringzero shards each bucket (unit) over the ranks, so a rank's partition is one block per unit: "
                "safe_get_local_fp32_param")
ACCUM = message("engine.optimizer.accumulated_grads_in_cpu", "keep a CPU buffer per parameter of its gradient "
                "accumulated over micro-batches (ZeRO-1/2 with offload_optimizer)",
                "the stage accumulates into its own gradient buffers; safe_get_full_grad(param) reads the sum so far")

AVERAGED = message("engine.optimizer.averaged_gradients at ZeRO-1/2 without offload_optimizer",
                   "list, per group, the gradient partition of each parameter in this rank's partition",
                   "ringzero reduces into one shard per unit (stage.gshard); safe_get_full_grad(param) reads any parameter's")


def install(engine) -> None:
    """parameter_offload (stage 3), fp16_groups / fp32_partitioned_groups_flat on engine.optimizer, each group's "params" the
    partition (bf16/fp16, stages 1-3, master in memory: else nothing is written)."""
    opt = engine.optimizer
    if engine.stage_id in (1, 2):
        opt.refused_names = {n: NotServedAttributeError(BIT16) for n in (
            "parallel_partitioned_bit16_groups", "parallel_partitioned_fp16_groups", "nccl_start_alignment_factor")}
        opt.refused_names["accumulated_grads_in_cpu"] = NotServedAttributeError(ACCUM)
        if engine.config.offload_optimizer is not None:
            opt.averaged_gradients = {}    # stage_1_and_2.py with offload: gradients go to the fp32 partitions
        else:
            opt.refused_names["averaged_gradients"] = NotServedAttributeError(AVERAGED)
        more_layout.install(engine, Live)
        opt.single_partition_of_fp32_groups = Live(lambda: partitions(engine))   # stage_1_and_2.py's name
    if engine.stage_id == 3:
        opt.parameter_offload = ParameterOffload(engine)
    opt.fp16_groups = Live(lambda: [[engine.params_by_name[n] for n in ns] for ns in engine.group_names])
    opt.fp32_partitioned_groups_flat = Live(lambda: partitions(engine))
    try:
        partitions(engine)
    except AttributeError:
        return
    for g, group in enumerate(opt.param_groups):
        group["params"] = Live(lambda g=g: [partitions(engine)[g]])


# ----------------------------------------------------------------------------- ZeRO-3's module hooks
def _kind_of(engine):
    """id(hook dict) → "forward" / "backward" for every module of the engine's model."""
    out = {}
    for m in engine.module.modules():
        out[id(m._forward_pre_hooks)] = out[id(m._forward_hooks)] = "forward"
        out[id(m._backward_pre_hooks)] = out[id(m._backward_hooks)] = "backward"
    return out


class ParameterOffload:
    """engine.optimizer.parameter_offload at stage 3 (DeepSpeedZeRoOffload's hook lists): the
    stage's module hooks that are registered now, as torch handles, read from the stage each time.
    unhook()/_register_deepspeed_module() take them off the modules and put them back in their
    places (unwrap_model_for_generation does both, as DeepSpeed's)."""

    def __init__(self, engine):
        self.engine, self.module, self._off = engine, engine.module, []

    def _hooks(self, kind: str) -> list:
        kinds = _kind_of(self.engine)
        out = []
        for h in getattr(self.engine.stage, "hooks", []):
            d = h.hooks_dict_ref()
            if d is not None and kinds.get(id(d)) == kind and h.id in d:
                out.append(h)
        return out

    @property
    def forward_hooks(self) -> list:
        return self._hooks("forward")

    @forward_hooks.setter
    def forward_hooks(self, value) -> None:   # DeepSpeed's unwrap empties its lists after removing the handles
        if list(value):
            raise ValueError("parameter_offload.forward_hooks: only [] may be assigned (the hooks are the stage's)")

    @property
    def backward_hooks(self) -> list:
        return self._hooks("backward")

    backward_hooks = backward_hooks.setter(forward_hooks.fset)

    def unhook(self) -> None:
        """Take every stage hook off its module, remembering each dict's order."""
        hooks = self.forward_hooks + self.backward_hooks
        dicts = {id(h.hooks_dict_ref()): h.hooks_dict_ref() for h in hooks}
        self._off.extend((d, list(d.items())) for d in dicts.values())
        for h in hooks:
            del h.hooks_dict_ref()[h.id]

    def _register_deepspeed_module(self, module=None) -> None:
        """Put the hooks back where they were (hooks added meanwhile stay, after them)."""
        for d, items in self._off:
            keep = {j for j, _ in items}
            later = [(k, v) for k, v in d.items() if k not in keep]
            d.clear()
            d.update(items + later)
        self._off = []
