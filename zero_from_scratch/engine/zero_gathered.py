"""deepspeed.zero.GatheredParameters: full parameters inside a block, for reading or for editing.

    with GatheredParameters(model.parameters()):                 # read (every rank enters)
        full = {n: p.clone() for n, p in model.named_parameters()}
    with GatheredParameters(model.fc.weight, modifier_rank=0):   # write on rank 0
        if rank == 0: model.fc.weight.zero_()

Parameters still held by zero.Init (zero_partition.py) are all-gathered on entry, (N-1)/N·b·numel
per rank, and on exit either dropped (modifier_rank=None) or partitioned again from the modifier's
value (a scatter, (N-1)/N·b·numel from that rank). Parameters an engine adopted go through the
engine's gathered_parameters (engine/stage3.py: its units are gathered; with modifier_rank the
unit is broadcast, every shard rewritten and the fp32 master refreshed). Both kinds may be mixed.
"""
from __future__ import annotations

import contextlib

import torch

from zero_from_scratch.engine import zero_partition as zp
from zero_from_scratch.engine.external import register_external_parameter
from zero_from_scratch.engine.zero_partition import STATE, ZeroParamStatus, is_zero_param


class GatheredParameters:
    """Full parameters inside the block (every rank of the group must enter it, in the same order).
    modifier_rank=None: read only, dropped on exit. modifier_rank=r: rank r's values are sent to
    every shard on exit (scatter for Init-held parameters; the engine's write_back for parameters an
    engine adopted, which also refreshes its fp32 master). fwd_module: the parameters are registered
    as external parameters of that module (register_external_parameter). Tensors that are not
    partitioned are ignored, as DeepSpeed does; enabled=False: a no-op."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        self.enabled, self.stack = enabled, None
        if not enabled:
            return
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        seen = {id(p): p for p in params if is_zero_param(p)}
        self.params = sorted(seen.values(), key=lambda p: p.ds_id)
        self.modifier_rank = modifier_rank
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self):
        if not self.enabled:
            return None
        held = [p for p in self.params if zp.held_by_init(p)]
        self.mine = [p for p in held if p.ds_status is not ZeroParamStatus.AVAILABLE]
        self.outer = [p for p in held if p.ds_status is ZeroParamStatus.AVAILABLE]   # an enclosing block's
        engines: dict = {}
        for p in self.params:
            e = zp.engine_of(p)
            if e is not None:
                engines.setdefault(id(e), (e, []))[1].append(p)
        self.adopted = [p for _, ps in engines.values() for p in ps]
        self.stack = contextlib.ExitStack()
        STATE.busy += 1
        try:
            for p in self.mine:
                zp.fetch(p)
            for e, ps in engines.values():
                self.stack.enter_context(e.gathered_parameters(ps, self.modifier_rank))
            _status(self.adopted)
        finally:
            STATE.busy -= 1
        return None

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        STATE.busy += 1
        try:
            self.stack.close()
            _status(self.adopted)
            for p in self.mine:
                if self.modifier_rank is None:
                    zp.release(p)
                else:
                    zp.partition(p, p.ds_process_group, self.modifier_rank)
            if self.modifier_rank is not None:
                for p in self.outer:        # the edit reaches the shards now; the enclosing block still reads it
                    zp.partition(p, p.ds_process_group, self.modifier_rank)
                    zp.fetch(p)
        finally:
            STATE.busy -= 1
        return False


def _status(params) -> None:
    """ds_status of engine-adopted parameters: AVAILABLE while the engine holds them full."""
    for p in params:
        p.ds_status = ZeroParamStatus.AVAILABLE if p.data.numel() == p.ds_numel else ZeroParamStatus.NOT_AVAILABLE
