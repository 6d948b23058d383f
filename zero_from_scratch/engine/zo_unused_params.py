"""zero_optimization.ignore_unused_parameters = false at ZeRO-1/2 with offload_optimizer: DeepSpeed's assert.

    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "ignore_unused_parameters": false}

DeepSpeed's ZeRO-1/2 with offload records a gradient norm for each parameter of this rank's partition
whose gradient reached it in a boundary backward (copy_grads_in_partition; the record is never
cleared), and its step's norm (complete_grad_norm_calculation_for_cpu_offload) asserts that every
parameter of the partition has one: a trainable parameter that never took part in a loss fails the
step with its AssertionError, whose words name the key. True (the default) tolerates it (its
gradient is 0). Without offload DeepSpeed checks nothing, so neither does this.
Here: a post-accumulate-grad hook per trainable parameter whose slot meets this rank's shard notes
the ones a boundary backward reached; the offloaded step asserts the rest are none, after one
1-element all-reduce so every rank fails together (DeepSpeed fails on the ranks that hold such a
parameter, and the others wait in its norm's all-reduce).
Cost: one hook call per parameter and backward; per step a set difference and an 8-byte all-reduce.
"""
from __future__ import annotations

import torch

MESSAGE = """
    This assert indicates that your module has parameters that
    were not used in producing loss.
    You can avoid this assert by
    (1) enable ignore_unused_parameters option in zero_optimization config;
    (2) making sure all trainable parameters and `forward` function
        outputs participate in calculating loss.
"""


class UnusedParameterCheck:
    """Wraps the offloaded optimizer states' step (offload.build installs it when the key is false)."""

    def __init__(self, engine, states):
        self.e, self.states, self.seen = engine, states, set()
        owner = engine.stage.owner()
        self.mine = []
        for u in engine.layout.units:
            lo, hi = u.shard_range(owner)
            for s in u.slots:
                if max(lo, s.offset) < min(hi, s.offset + s.numel):
                    self.mine.append(s.name)
        self.hooks = [engine.params_by_name[n].register_post_accumulate_grad_hook(self._hook(n)) for n in self.mine]

    def _hook(self, name: str):
        def hook(_):
            if self.e.stage.boundary:        # DeepSpeed records the norm in the boundary backward only
                self.seen.add(name)
        return hook

    def step(self, coef: float, scale: float) -> None:
        missing = [n for n in self.mine if n not in self.seen]
        flag = torch.tensor([float(bool(missing))], device=self.e.device)
        if self.e.comm.size > 1:
            self.e.comm.all_reduce(flag, purpose="ignore_unused_parameters check")
            self.e.comm.usage.pop("ignore_unused_parameters check", None)
        if flag.item():
            where = f"rank {self.e.comm.rank}: never used: {missing}" if missing else \
                f"rank {self.e.comm.rank}: another rank holds a parameter never used"
            raise AssertionError(f"{MESSAGE}    ({where}; zero_optimization.ignore_unused_parameters is false)")
        self.states.step(coef, scale)

    def __getattr__(self, name):          # everything else is the wrapped states'
        return getattr(self.states, name)


def wrap(engine, states):
    """states, with DeepSpeed's check when ignore_unused_parameters is false at stages 1-2."""
    z = engine.config.raw.get("zero_optimization") or {}
    if states is None or engine.stage_id not in (1, 2) or z.get("ignore_unused_parameters", True) is not False:
        return states
    return UnusedParameterCheck(engine, states)
