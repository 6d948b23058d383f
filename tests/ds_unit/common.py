"""DeepSpeed's tests/unit/common.py helpers that the ported bodies call (the DistributedTest harness is harness.py).

    python -m pytest -q tests/test_ds_unit_bodies.py

Upstream: deepspeedai/DeepSpeed tests/unit/common.py at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641
(Apache-2.0, Copyright (c) Microsoft Corporation, DeepSpeed Team): preferred_dtype, reduce_boolean_flags,
allclose_on_all_ranks, unchanged. `deepspeed` is whichever the harness installed: the real package or
ringzero's runner (zero_from_scratch.as_deepspeed). Cost: one all-gather of a flag per comparison.
"""
import torch
from torch.testing import assert_close as torch_assert_close

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator


def preferred_dtype():
    if get_accelerator().is_bf16_supported():
        return torch.bfloat16
    elif get_accelerator().is_fp16_supported():
        return torch.float16
    else:
        return torch.float32


def reduce_boolean_flags(flag: bool, op=all) -> bool:
    if not dist.is_initialized():
        return flag
    device = get_accelerator().current_device()
    tensor_flag = torch.tensor(1 if flag else 0, dtype=torch.int, device=device)
    world_size = dist.get_world_size()
    tensor_flag_buf = torch.zeros(world_size, dtype=torch.int, device=device)
    dist.all_gather_into_tensor(tensor_flag_buf, tensor_flag)
    list_flags = [bool(f) for f in tensor_flag_buf.tolist()]
    return op(list_flags)


def allclose_on_all_ranks(actual, expected, assert_message=None, **kwargs) -> None:
    """
    Compare two tensors across all ranks.
    We want to make sure that all ranks succeed or fail together.
    """
    allclose_local = False
    allclose_global = False
    mismatch_msg = ""
    try:
        torch_assert_close(actual, expected, **kwargs)
        allclose_local = True
        allclose_global = reduce_boolean_flags(allclose_local, all)
    except AssertionError:
        allclose_global = reduce_boolean_flags(allclose_local, all)
        mismatch_msg = f"Tensors are not close: {actual=}, {expected=} {kwargs=}"

    if not allclose_global:
        message = "Tensors are not close on all ranks." if assert_message is None else assert_message
        raise AssertionError(f"{message} {mismatch_msg}")
