"""What DeepSpeed 0.19.8's ZeRO-3 does to a model at initialize, before its hooks, under the runner.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json      (stage 3)

runtime/zero/parameter_offload.py (DeepSpeedZeRoOffload.__init__), in this order:
  every module                              its own pre_bwd_fn / post_bwd_fn autograd classes and
        applied_pre_backward_ref_cnt (engine/z3_outputs.py per_module_functions)
  no parameter partitioned yet              Init(module=model, config): DeepSpeed's ZeRO-3 Linear
        in place of torch.nn.functional.linear unless memory_efficient_linear is false (z3lin_linear.py)
ringzero's own initialize does neither (torch's F.linear stays). stage3_module_granularity_threshold's leaves
are flagged by the engine itself on both paths (engine/leaf.py install).
Cost: one walk over the modules.
"""
from __future__ import annotations

from zero_from_scratch.as_deepspeed import z3lin_linear
from zero_from_scratch.engine import z3_outputs
from zero_from_scratch.engine.zero_partition import is_zero_param


def before(model, config) -> None:
    z = (config.get("zero_optimization") or {}) if isinstance(config, dict) else {}
    if str(z.get("stage", 0)) != "3":
        return
    z3_outputs.per_module_functions(model)
    params = list(model.parameters())
    # DeepSpeed calls Init(module=) (which swaps) only when no parameter is partitioned yet; a mixed
    # model goes through convert_to_zero_parameters, which does not swap
    if z3lin_linear.wanted(config) and params and not any(is_zero_param(p) for p in params):
        z3lin_linear.enable()
