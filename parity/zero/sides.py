"""Either side of a DeepSpeed comparison, built from one config: the only harness module that imports deepspeed.

    python -c "from parity.zero.sides import prepare_deepspeed; prepare_deepspeed()"

make_engine("deepspeed" | "ours", model, param_groups, config) builds deepspeed.initialize's engine
or zero_from_scratch.initialize's; full_params gathers every parameter (ZeRO-3 included) into fp32
CPU copies; prepare_deepspeed and peak_rss_bytes (zero_from_scratch/engine/real_deepspeed.py) are
re-exported for the harnesses. Used by the parity harness, the
classification engines and benchmarks/zero_vs_deepspeed.py. Cost: an engine build; full_params at
stage 3 is one all-gather of Ψ.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.real_deepspeed import peak_rss_bytes, prepare_deepspeed, skip_shm_op_build  # noqa: F401

SIDES = ("deepspeed", "ours")


def make_engine(side: str, model: nn.Module, groups, config: dict, comm_impl: str):
    if side == "deepspeed":
        deepspeed = prepare_deepspeed()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        return engine
    if side == "ours":
        kw = {} if comm_impl == "primitives" else {"comm_impl": comm_impl}
        engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=groups, config=config, **kw)
        return engine
    raise ValueError(f"side must be one of {SIDES}, got {side!r}")


def _gather_context(side: str, engine, params: list, stage: int):
    if stage < 3:
        return contextlib.nullcontext()
    if side == "deepspeed":
        return prepare_deepspeed().zero.GatheredParameters(params, modifier_rank=None)
    gather = getattr(zero_from_scratch, "gathered_parameters", None) or engine.gathered_parameters
    return gather(params, modifier_rank=None)


def full_params(side: str, engine, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter, full size, as an fp32 CPU copy (gathered first under ZeRO-3)."""
    named = list(engine.module.named_parameters())
    with _gather_context(side, engine, [p for _, p in named], stage):
        return {n: p.detach().float().cpu().clone() for n, p in named}
