"""Under the runner, the ZeRO engine's collectives are calls of deepspeed.comm's names, as DeepSpeed's are.

    python -m zero_from_scratch.as_deepspeed train.py      (deepspeed.initialize calls install(engine))
    python -m pytest tests/test_ds_served_comm.py         (2 ranks: counted calls, and the same bits)

DeepSpeed's ZeRO stages reduce and gather through `deepspeed.comm` (stage_1_and_2.py's dist.all_reduce,
stage3.py's dist.reduce_scatter_fn by way of reduce_scatter_coalesced, partition_parameters.py's
dist.allgather_fn, which calls all_gather_into_tensor), so a script that patches `deepspeed.comm.all_reduce`
& co. to count or wrap collectives sees the training's own. Here the engine's Comm (engine/comm.py call_through) calls the served module's name for each collective it
issues, looked up at each call, with DeepSpeed's signature (the engine's algorithm and divergence tag travel
beside it, in ENGINE_CALL): a unit's gradient reduce-scatter is `reduce_scatter_fn` (its pieces, for a
unit over comm.RS_PIECE_BYTES per rank, `reduce_scatter`), an all-reduce `all_reduce`, a parameter gather
`allgather_fn` at ZeRO-3 and `all_gather_into_tensor` at stages 1-2 (as DeepSpeed's), a broadcast `broadcast`. Which collective runs is ringzero's own (its stage 2
reduce-scatters where DeepSpeed's all-reduces or reduces a bucket), with the engine's algorithm and
divergence tag. ringzero's own entry points are unchanged (they never call this).
Cost: one Python call per collective (~1 us); the same bytes and bits.
"""
from __future__ import annotations

import contextvars
import functools
import importlib
import sys

from zero_from_scratch.as_deepspeed.finder import ServedModule

# The engine's collective in flight: its algorithm and divergence tag, read by the served functions
# (as_deepspeed/comm.py), so those keep DeepSpeed's signatures and a script's patch written with them works.
# Empty outside such a call: primitives' defaults.
ENGINE_CALL: contextvars.ContextVar[dict] = contextvars.ContextVar("ringzero_engine_call", default={})


def install(engine) -> None:
    comm = getattr(engine, "comm", None)
    if comm is None or not hasattr(comm, "call_through") or not isinstance(sys.modules.get("deepspeed"), ServedModule):
        return      # the pipeline engine, or initialize called without the runner's `deepspeed`
    # DeepSpeed's ZeRO-3 gathers call dist.allgather_fn (partition_parameters.py), its stages 1-2 the
    # post-step dist.all_gather_into_tensor (runtime/utils.py all_gather_dp_groups)
    gather = "allgather_fn" if engine.zero_optimization_stage() == 3 else "all_gather_into_tensor"
    comm.call_through(functools.partial(_call, importlib.import_module("deepspeed.comm")), gather=gather)


def _call(names, name: str, *args, algorithm: str = "auto", tag: int = 0, **kwargs):
    token = ENGINE_CALL.set({"algorithm": algorithm, "tag": tag})
    try:
        return getattr(names, name)(*args, **kwargs)
    finally:
        ENGINE_CALL.reset(token)
