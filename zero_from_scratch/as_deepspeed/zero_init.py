"""`deepspeed.zero.Init` under the runner: ringzero's Init (engine/zero_init.py), started as DeepSpeed starts it.

    with deepspeed.zero.Init():            (under python -m zero_from_scratch.as_deepspeed SCRIPT)
        model = build()

DeepSpeed's Init starts torch.distributed itself when nobody has (runtime/zero/partition_parameters.py,
Init.__init__: `if not dist.is_initialized(): init_distributed()`), so a script may enter Init
before deepspeed.initialize; here the runner's init_distributed does the same (launcher variables,
or rank 0 of 1), then ringzero's Init partitions. Cost: one check.
"""
from __future__ import annotations

import torch.distributed as dist

from zero_from_scratch.as_deepspeed.top import init_distributed
from zero_from_scratch.engine import zero_init


class Init(zero_init.Init):
    def __init__(self, *args, **kwargs):
        if not dist.is_initialized():
            init_distributed()
            assert dist.is_initialized(), "Parameters cannot be scattered without initializing deepspeed.comm"
        super().__init__(*args, **kwargs)
