"""Either side of a DeepSpeed comparison, built from one config: the only module that imports deepspeed.

    python -c "from zero_from_scratch.parity.sides import prepare_deepspeed; prepare_deepspeed()"

make_engine("deepspeed" | "ours", model, param_groups, config) builds deepspeed.initialize's engine
or zero_from_scratch.initialize's; full_params gathers every parameter (ZeRO-3 included) into fp32
CPU copies; peak_rss_bytes reads the process's peak resident set. Used by the parity harness, the
classification engines and benchmarks/zero_vs_deepspeed.py. Cost: an engine build; full_params at
stage 3 is one all-gather of Ψ.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.nn as nn
import zero_from_scratch

SIDES = ("deepspeed", "ours")
SHM_OP = "deepspeed_shm_comm"


def prepare_deepspeed(skip_shm_build: bool = True):
    """Import deepspeed quietly; by default mark its shared-memory comm op as incompatible.

    deepspeed.comm's TorchBackend JIT-builds `deepspeed_shm_comm` (~1 min on 2 busy cores, then
    cached in TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) on its first use on CPU.
    That op only backs `inference_all_reduce`; training collectives go to torch.distributed
    (gloo). Marking it incompatible makes build_shm_op() return None: no build, same numerics.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # before import: it logs at import
    import deepspeed  # optional dependency
    import deepspeed.ops  # optional dependency
    deepspeed.utils.logger.setLevel(logging.ERROR)
    if skip_shm_build:
        skip_shm_op_build()
    return deepspeed


def skip_shm_op_build() -> None:
    """Mark DeepSpeed's `deepspeed_shm_comm` op incompatible, so it is never JIT-built (it serves
    only inference_all_reduce; ZeRO training goes through torch.distributed)."""
    import deepspeed.ops  # optional dependency
    deepspeed.ops.__compatible_ops__[SHM_OP] = False  # lazy dict: probe first, then override


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


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1
