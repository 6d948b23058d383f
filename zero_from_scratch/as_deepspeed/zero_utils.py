"""deepspeed.runtime.zero.utils under the runner: the names scripts and DeepSpeed's tests use.

    import deepspeed                       (under python -m zero_from_scratch.as_deepspeed SCRIPT)
    with pytest.raises(deepspeed.runtime.zero.utils.ZeRORuntimeException): ...

ZeRORuntimeException   the exception class DeepSpeed's ZeRO raises on a checkpoint it cannot load
                       (runtime/zero/utils.py); ringzero raises it where DeepSpeed does.
is_zero_param(p)       a tensor with a `ds_id` (a ZeRO-3 partitioned parameter), as DeepSpeed.
is_builtin_type, isinstance_namedtuple   DeepSpeed's two type tests, verbatim in meaning.
unwrap_model_for_generation(engine)   a context in which every parameter is whole (ZeRO-3: gathered
                       once by GatheredParameters, as runtime/zero/stage3.py does for generate()),
                       with stage 3's module hooks taken off the modules and put back after, as
                       DeepSpeed's (engine.optimizer.parameter_offload, zero_layout.py).
Cost: none; unwrap_model_for_generation one all-gather of the model.
"""
from __future__ import annotations

import contextlib

import torch

from zero_from_scratch.engine.client_optim import ZeRORuntimeException   # raised by the engine, served here


def is_zero_param(parameter) -> bool:
    return torch.is_tensor(parameter) and hasattr(parameter, "ds_id")


def is_builtin_type(obj) -> bool:
    return obj.__class__.__module__ in ("__builtin__", "builtins")


def isinstance_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    from zero_from_scratch.engine.zero_init import GatheredParameters   # keeps zero_utils free of the engine
    with GatheredParameters(list(model.parameters())):
        off = getattr(getattr(model, "optimizer", None), "parameter_offload", None)   # as_deepspeed/zero_layout.py
        if off is None:
            yield model
            return
        off.unhook()
        try:
            yield model
        finally:
            off._register_deepspeed_module(off.module)
