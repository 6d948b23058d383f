"""The config keys that change how gradients are reduced, read with DeepSpeed 0.19.8's meaning.

    python -c "from zero_from_scratch.engine.grad_keys import parse; print(parse({'prescale_gradients': True}, 0, True, 'fp32', 2))"

Cost: nothing at run time beyond one multiply of the loss before backward.
DeepSpeed (runtime/engine.py allreduce_bucket, zero/stage_1_and_2.py gradient_reduction_w_predivide):
  gradient_allreduce_op "mean" (default)  each rank's gradients are averaged over the N ranks;
                        "sum"             summed, never divided by N (ValueError at stage 3 in DeepSpeed).
  prescale_gradients true                 divide by N BEFORE the reduction (postscale: after).
  gradient_predivide_factor f             divide by f before the reduction, multiply by f/N after.
Stages 1-2 with reduce_scatter true divide by N before the reduce-scatter whatever these say; stage 2
and 3 then assert predivide == 1 and no prescale (zero/stage_1_and_2.py, zero/stage3.py __init__).
Here the reduction is a SUM of gradients of the loss × `pre`, and the step divides by `post_divisor`
× loss_scale: the same numbers DeepSpeed reduces (so fp16's range is used the same way) and the same
result. The multiply happens on the loss, not on each bucket: gradients are linear in the loss.
communication_data_type: DeepSpeed casts each bucket to it for the reduction; this engine reduces in
the model's dtype, so only that value (DeepSpeed's default) is accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("fp32", "fp16", "bf16")


@dataclass
class Reduction:
    average: bool = True          # gradient_allreduce_op "mean"
    pre: float = 1.0              # the loss (hence every gradient) is multiplied by this before backward
    post_divisor: float = 1.0     # the reduced gradients are divided by this (and by the loss scale):
                                  # N·pre averaging, pre summing


def _refuse(key, value, stage, why):
    return ValueError(f"config key {key!r} = {value!r} is refused at ZeRO stage {stage}: {why}")


def parse(raw: dict, stage: int, reduce_scatter: bool, model_dtype: str, world_size: int = 1) -> Reduction:
    """Reduction for a config dict; ValueError for what DeepSpeed refuses or this engine cannot do."""
    op = str(raw.get("gradient_allreduce_op", "mean")).lower()
    if op not in ("mean", "sum"):
        raise ValueError(f"config key 'gradient_allreduce_op' = {op!r} is invalid; allowed: ['mean', 'sum']")
    if op == "sum" and stage == 3:
        raise _refuse("gradient_allreduce_op", op, 3, "DeepSpeed raises ValueError too (ZeRO-3 always averages)")
    pres = raw.get("prescale_gradients", False)
    f = raw.get("gradient_predivide_factor", 1.0)
    if not isinstance(pres, bool):
        raise ValueError(f"config key 'prescale_gradients' = {pres!r} is invalid; allowed: true/false")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or f <= 0:
        raise ValueError(f"config key 'gradient_predivide_factor' = {f!r} is invalid; allowed: a number > 0")
    asserts = op == "mean" and reduce_scatter and stage in (2, 3)
    if asserts and f != 1.0:
        raise _refuse("gradient_predivide_factor", f, stage, "DeepSpeed asserts it is 1.0 with reduce_scatter "
                      "(gradients are divided by N before the reduce-scatter); set reduce_scatter false at stage 2")
    if asserts and pres:
        raise _refuse("prescale_gradients", pres, stage, "DeepSpeed asserts it is false with reduce_scatter "
                      "(gradients are divided by N before the reduce-scatter anyway)")
    cdt = raw.get("communication_data_type")
    if cdt is not None and str(cdt).lower() != model_dtype:
        if str(cdt).lower() not in DTYPES:
            raise ValueError(f"config key 'communication_data_type' = {cdt!r} is invalid; allowed: {list(DTYPES)}")
        raise ValueError(f"config key 'communication_data_type' = {cdt!r} is refused: DeepSpeed would cast each "
                         f"gradient bucket to {cdt} for the reduction and back; this engine reduces in the model's "
                         f"dtype ({model_dtype}), the only value accepted")
    auto_cast = (raw.get("fp16") or {}).get("auto_cast", False)
    if auto_cast:
        raise ValueError("config key 'fp16.auto_cast' = true is refused: DeepSpeed would cast every floating-point "
                         "input of forward to fp16; cast the batch to torch.float16 yourself")
    N = world_size
    if op == "sum":
        return Reduction(False, 1.0, 1.0)
    if pres and not (stage == 1 and reduce_scatter):  # stage 1 + reduce_scatter: DeepSpeed ignores it (warned)
        return Reduction(True, 1.0 / N, 1.0)
    if f != 1.0 and not (stage == 1 and reduce_scatter):
        return Reduction(True, 1.0 / f, N / f)
    return Reduction(True, 1.0, float(N))          # the sum, divided by N after the reduction


def predivide_ignored(raw: dict, stage: int, reduce_scatter: bool) -> str | None:
    """The warning for gradient_predivide_factor / prescale_gradients where DeepSpeed accepts them and
    ignores them: with gradient_allreduce_op "sum", and at stage 1 with reduce_scatter (it divides by N first)."""
    keys = [k for k, off in (("gradient_predivide_factor", 1.0), ("prescale_gradients", False))
            if raw.get(k, off) != off]
    summing = str(raw.get("gradient_allreduce_op", "mean")).lower() == "sum"
    if keys and summing:
        return (f"{', '.join(keys)}: no effect with gradient_allreduce_op 'sum': DeepSpeed (and this engine) "
                "then reduce the gradients without any division")
    if stage == 1 and reduce_scatter and keys:
        return (f"{', '.join(keys)}: no effect at stage 1 with reduce_scatter: DeepSpeed (and this engine) divide "
                "each gradient bucket by N before the reduce-scatter whatever they say")
    return None
