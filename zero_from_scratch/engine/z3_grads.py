"""DeepSpeed's ZeRO-3 gradient names, read from ringzero's reduced gradient shards.

    python -m pytest -q tests/test_zero3_grads.py

  engine.allreduce_gradients()             DeepSpeed's engine (engine.py) ends the micro-batch's
                                           reduction (stage 3: the optimizer's ipg epilogue); its
                                           backward has called it already. ringzero's backward ends
                                           with every unit reduce-scattered: this waits for any still
                                           in flight (overlap_comm) and reduces nothing twice.
  engine.optimizer.averaged_gradients[g]   DeepSpeed's stage 3 (stage3.py, the epilogue): for sub-group
                                           g, this rank's partition of each parameter's averaged
                                           gradient, elements [r·⌈n/N⌉, (r+1)·⌈n/N⌉) zero-padded,
                                           summed over micro-batches until the step (and, in
                                           fp16, still multiplied by the loss scale).

ringzero's unit is a whole module, and rank r holds the same slice [r·⌈n/N⌉, …) of the module's
flat buffer; for a module holding one parameter that slice is the parameter's partition, so the
entry is this rank's gradient shard, read at access, divided by N (grad_keys.py: ringzero's
reduction sums and the step divides; a view where nothing is left to divide). A parameter that
shares its module with others has its partition spread over other ranks' shards, which no rank
stores: reading its group raises with that reason. With offload_optimizer DeepSpeed leaves the
dict empty (the gradients go to its fp32 partitions): so does this. Sub-groups are ringzero's
parameter groups (sub_group_size only paces DeepSpeed's offload). Cost: none until read; then one divide per parameter.
"""
from __future__ import annotations

from collections.abc import Mapping


def allreduce_gradients(engine, bucket_size=None) -> None:
    """DeepSpeedEngine.allreduce_gradients (bucket_size: DeepSpeed's buffer size for stages 0-1)."""
    wait = getattr(engine.stage, "wait_all", None)
    if wait is not None:
        wait()


class AveragedGradients(Mapping):
    """engine.optimizer.averaged_gradients at stage 3: {group: [partition view per parameter]}."""

    def __init__(self, engine):
        self.e = engine

    def _groups(self) -> range:
        return range(0 if self.e.offload is not None else len(self.e.group_names))

    def __iter__(self):
        return iter(self._groups())

    def __len__(self) -> int:
        return len(self._groups())

    def __getitem__(self, g):
        if g not in self._groups():
            raise KeyError(g)
        e = self.e
        unit_of = {s.name: u for u in e.layout.units for s in u.slots}
        out = []
        for n in e.group_names[g]:
            u = unit_of[n]
            if len(u.slots) > 1:
                raise NotImplementedError(
                    f"averaged_gradients: parameter {n!r} shares its ZeRO-3 unit {u.tag!r} with {len(u.slots) - 1} "
                    "other(s); ringzero's units are whole modules, so this rank's DeepSpeed partition of that "
                    "parameter's gradient lies in other ranks' shards (only one-parameter modules have one)")
            div = e.config.reduction.post_divisor       # ringzero reduces sums and divides at the step
            out.append(e.stage.grad_shard(u) / div if div != 1 else e.stage.grad_shard(u))
        return out


def install(engine) -> None:
    """At stage 3, after the optimizer is built."""
    if engine.stage_id == 3:
        engine.optimizer.averaged_gradients = AveragedGradients(engine)
