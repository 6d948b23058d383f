"""zero_optimization.ignore_unused_parameters = false at ZeRO-1/2 with offload_optimizer: DeepSpeed's assert.

    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "ignore_unused_parameters": false}

DeepSpeed's ZeRO-1/2 with offload records a gradient norm for each parameter of this rank's partition
that copy_grads_in_partition copies at the accumulation boundary, and its step's norm
(complete_grad_norm_calculation_for_cpu_offload, computed only when the step did not overflow)
asserts that every parameter of the partition has one: a trainable parameter that took no part in
the step's loss fails the step with its AssertionError, whose words name the key. The record is
emptied after every step, a skipped one too (reset_cpu_buffers), so the check is per step. Which
backwards count: at stage 2, and at stage 1 with overlap_comm, the gradient hooks copy in the
boundary backward only; at stage 1 without overlap_comm reduce_gradients copies, at the boundary,
every parameter holding a gradient accumulated in any micro-batch of the step. True (the default)
tolerates an unused parameter (its gradient is 0). Without offload DeepSpeed checks nothing, so
neither does this.
Here: a post-accumulate-grad hook per trainable parameter whose slot meets this rank's shard stamps
it with the optimizer step (engine.global_steps, which a skipped step advances too) when a backward
that counts reaches it; the offloaded step (never reached on overflow) asserts every such parameter
carries this step's stamp, after one 1-element all-reduce (shown in comm_report) so every rank fails
together (DeepSpeed fails on the ranks that hold such a parameter, and the others wait in its
norm's all-reduce).
Cost: one hook call per parameter and backward; per step a scan of the stamps and an 8-byte all-reduce.
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
        self.e, self.states, self.seen = engine, states, {}     # name -> global_steps of its last counted backward
        # stage 1 without overlap_comm: reduce_gradients copies every accumulated gradient at the boundary
        self.any_micro = engine.stage_id == 1 and not engine.config.zero.overlap_comm
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
            if self.any_micro or self.e.stage.boundary:
                self.seen[name] = self.e.global_steps
        return hook

    def step(self, coef: float, scale: float) -> None:
        now = self.e.global_steps
        missing = [n for n in self.mine if self.seen.get(n) != now]
        flag = torch.tensor([float(bool(missing))], device=self.e.device)
        if self.e.comm.size > 1:
            self.e.comm.all_reduce(flag, purpose="ignore_unused_parameters check")
        if flag.item():
            where = f"rank {self.e.comm.rank}: unused this step: {missing}" if missing else \
                f"rank {self.e.comm.rank}: another rank holds a parameter unused this step"
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
