"""`deepspeed.checkpointing` (runtime/activation_checkpointing/checkpointing.py) under the runner.

    deepspeed.checkpointing.configure(None, partition_activations=True)   (under the runner)
    y = deepspeed.checkpointing.checkpoint(block, x)

checkpoint   DeepSpeed's default, reentrant (engine/activation_checkpointing.py::reentrant_checkpoint): a
             block none of whose inputs requires grad runs non-reentrant, warned once (DeepSpeed's would
             leave its parameters without gradients); one extra forward of the block in backward.
non_reentrant_checkpoint   torch's non-reentrant checkpoint: the same numbers.
configure(mpu_, deepspeed_config=None, ...)   records the settings; partition_activations,
             contiguous_checkpointing, checkpoint_in_cpu, synchronize, profile set true are warned once
             (they split activations over model-parallel ranks or tune CUDA memory: nothing to do here),
             as the engine warns for the config's `activation_checkpointing` section.
is_configured(), reset()   as DeepSpeed's. Cost: none beyond torch's checkpoint.
"""
from __future__ import annotations

from zero_from_scratch.as_deepspeed.utils import logger
from zero_from_scratch.engine.activation_checkpointing import checkpoint as non_reentrant_checkpoint
from zero_from_scratch.engine.activation_checkpointing import reentrant_checkpoint as checkpoint
_SETTINGS: dict = {}
_NO_EFFECT = ("partition_activations", "contiguous_checkpointing", "checkpoint_in_cpu", "synchronize", "profile")


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    given = dict(partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
                 num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
                 profile=profile)
    if contiguous_checkpointing:    # DeepSpeed's two checks, in its words (a setting not given keeps the last call's)
        def now(k):
            return given[k] if given[k] is not None else _SETTINGS.get(k)
        assert now("partition_activations"), ("Contiguous Checkpointing is only available with partitioned "
                                              "activations. Set partitioned activations to true in deepspeed config")
        assert now("num_checkpoints") is not None, "Must specify the number of layers with contiguous memory checkpointing"
    _SETTINGS.clear()
    _SETTINGS.update({k: v for k, v in given.items() if v is not None}, mpu=mpu_)
    on = [k for k in _NO_EFFECT if given[k]]
    if on:
        logger.warning(f"deepspeed.checkpointing.configure: {', '.join(on)} have no effect here (no model-parallel "
                       "ranks to partition activations over, no CUDA memory to tune); checkpoint() recomputes as usual")


def is_configured() -> bool:
    return bool(_SETTINGS)


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; there are none."""
