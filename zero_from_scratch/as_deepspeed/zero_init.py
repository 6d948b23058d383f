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

from zero_from_scratch.as_deepspeed import finder, served
from zero_from_scratch.as_deepspeed.top import init_distributed
from zero_from_scratch.engine import zero_init


class _Refusing(type):
    """DeepSpeed's Init internals ringzero refuses (served.REFUSED) raise the one-line error when read."""

    def __getattr__(cls, attr):
        name = f"deepspeed.runtime.zero.partition_parameters.Init.{attr}"
        if name in served.REFUSED:
            raise finder.NotServedAttributeError(finder.message(name, *served.REFUSED[name]))
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {attr!r}")


class Init(zero_init.Init, metaclass=_Refusing):
    def __init__(self, *args, **kwargs):
        if not dist.is_initialized():
            init_distributed()
            assert dist.is_initialized(), "Parameters cannot be scattered without initializing deepspeed.comm"
        super().__init__(*args, **kwargs)
