"""DeepSpeed engine methods ringzero does not serve, refused in one line when called.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    (top.initialize calls install(engine) on the engine it returns)

engine.coalesce_grad_reduction() (DeepSpeed 0.19.x, runtime/engine.py): a with-block whose
engine.backward() calls leave their gradients on the parameters, reduced in one pass when the
block exits (ZeRO stages 1-3). ringzero's stages reduce on their own schedule (stage 2-3 every
micro-batch into shards, stage 1 at the boundary): deferring that to a block's exit is not
implemented, so the call says so instead of an AttributeError. Cost: one attribute per engine.
"""
from __future__ import annotations

from zero_from_scratch.as_deepspeed.finder import NotServedError, message

COALESCE = message("engine.coalesce_grad_reduction()", "leave the gradients of every engine.backward() in the block "
                   "on the parameters and reduce them in one pass when it exits (ZeRO stages 1-3)",
                   "gradient_accumulation_steps (one reduction per accumulation boundary at stage 1; "
                   "engine.no_sync() at stages 0-1)")


def _coalesce_grad_reduction(*args, **kwargs):
    raise NotServedError(COALESCE)


def install(engine) -> None:
    if not hasattr(engine, "coalesce_grad_reduction"):
        engine.coalesce_grad_reduction = _coalesce_grad_reduction
