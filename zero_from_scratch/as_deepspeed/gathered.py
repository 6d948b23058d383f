"""deepspeed.zero.GatheredParameters under the runner: DeepSpeed 0.19.8's no-op on parameters ZeRO-3 has not partitioned.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    with deepspeed.zero.GatheredParameters(model.fc.weight, modifier_rank=0):   # at ZeRO 0-2: nothing happens
        if rank == 0: model.fc.weight.data.zero_()                             # rank 0's weight only

DeepSpeed's context enables itself only when one of the parameters is a ZeRO parameter (it has a ds_id:
zero.Init built it, or the ZeRO-3 engine partitioned it); otherwise it returns at once and modifier_rank is
read by nothing (runtime/zero/partition_parameters.py GatheredParameters.__init__: `if not any(is_zero_param(p)
for p in params): self.enabled = False`). At ZeRO stages 0-2 no parameter has one, so an edit made inside
the block by the modifier rank stays on that rank. The runner serves the same class as ringzero's own
(engine/zero_gathered.py, which leaves such tensors alone too) and says once, on rank 0, that modifier_rank is
ignored there. ringzero's own engine.gathered_parameters / zero_from_scratch.gathered_parameters keep
broadcasting the modifier's edit at stages 0-2 (engine/stages.py gathered_replicated).
Cost: a walk over the parameters given, once per block.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zero_from_scratch.as_deepspeed.utils import logger
from zero_from_scratch.engine.zero_gathered import GatheredParameters as _Gathered
from zero_from_scratch.engine.zero_partition import is_zero_param

_SAID: list[bool] = []     # the warning is given once per process


class GatheredParameters(_Gathered):
    """ringzero's GatheredParameters; with modifier_rank on parameters none of which ZeRO-3 partitioned, one
    warning (rank 0) that DeepSpeed ignores modifier_rank there, then DeepSpeed's no-op."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        elif enabled:
            params = list(params)   # a generator is read twice: here and by the base class
        if enabled and modifier_rank is not None and not any(is_zero_param(p) for p in params):
            _say_once(modifier_rank)
        super().__init__(params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)


def _say_once(modifier_rank) -> None:
    if _SAID:
        return
    _SAID.append(True)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning(f"deepspeed.zero.GatheredParameters(modifier_rank={modifier_rank}) on parameters ZeRO-3 has "
                       "not partitioned (ZeRO stages 0-2): DeepSpeed ignores modifier_rank there (the block does "
                       "nothing; edits stay on the rank that made them); so does the runner")
