"""deepspeed.runtime.zero.utils under the runner: the names scripts and DeepSpeed's tests use.

    import deepspeed                       (under python -m zero_from_scratch.as_deepspeed SCRIPT)
    with pytest.raises(deepspeed.runtime.zero.utils.ZeRORuntimeException): ...

ZeRORuntimeException   the exception class DeepSpeed's ZeRO raises on a checkpoint it cannot load
                       (runtime/zero/utils.py); ringzero raises it where DeepSpeed does.
is_zero_param(p)       a tensor with a `ds_id` (a ZeRO-3 partitioned parameter), as DeepSpeed.
is_builtin_type, isinstance_namedtuple   DeepSpeed's two type tests, verbatim in meaning.
Cost: none.
"""
from __future__ import annotations

import torch


class ZeRORuntimeException(Exception):
    pass


def is_zero_param(parameter) -> bool:
    return torch.is_tensor(parameter) and hasattr(parameter, "ds_id")


def is_builtin_type(obj) -> bool:
    return obj.__class__.__module__ in ("__builtin__", "builtins")


def isinstance_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")
