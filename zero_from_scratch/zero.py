"""DeepSpeed's `deepspeed.zero` namespace over this engine: `Init` and `GatheredParameters`.

    python -c "from zero_from_scratch import zero; print(zero.Init, zero.GatheredParameters)"
"""
from __future__ import annotations


class Init:
    """deepspeed.zero.Init: not served yet by this engine."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("zero_from_scratch.zero.Init is not served yet: DeepSpeed would partition "
                                  "each module's parameters as it is built; build the model, then initialize()")


class GatheredParameters:
    """deepspeed.zero.GatheredParameters: not served yet by this engine."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("zero_from_scratch.zero.GatheredParameters is not served yet: DeepSpeed would "
                                  "all-gather the listed ZeRO-3 parameters for the with-block")
