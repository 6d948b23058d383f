"""DeepSpeed's tests/unit/runtime/zero/test_zero_tensor_fragment.py (safe_get/set_full_*, safe_*_local_*,
safe_update_full_grad_vectorized), as plain functions (harness.py): the set half.

    python -m tests.ds_unit.harness test_fragments_set test_fragments_update

Upstream: deepspeedai/DeepSpeed tests/unit/runtime/zero/test_zero_tensor_fragment.py at commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (Apache-2.0, Copyright (c) Microsoft Corporation, DeepSpeed Team).
TestTensorFragmentSet/Update.test_zero_fragments → test_fragments_set/_update (no self; the parametrization
is in selection.py); the helpers unchanged; the module constants and run_fragmented_model come from
fragment_get_bodies.py, where upstream's file defines them above. Imports: upstream's, less `bf16_required_version_check`
(tests/unit/util.py; only a bf16 TestTensorFragmentSet reaches it, and selection.py runs none).
Cost: each body trains 10 steps of a model of ~1-3 M parameters (hidden_dim from MIN_SWAPPABLE_BYTES).
"""
import pytest
import deepspeed.comm as dist
import torch
import math

from tests.ds_unit.simple_model import random_dataloader, SimpleModel

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state
from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state
from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state
from deepspeed.utils import safe_update_full_grad_vectorized
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.ops.aio import AsyncIOBuilder
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
from tests.ds_unit.fragment_get_bodies import (WEIGHT_KEY, FIRST_ORDER_KEY, SECOND_ORDER_KEY, GRADIENT_KEY,
                                              run_fragmented_model)


def create_random_values(model, key_list, group, grad_dtype):
    param_values = {}
    for n, lp in model.named_parameters():
        param_shape = lp.ds_shape if hasattr(lp, 'ds_id') else lp.shape
        param_values[n] = {}
        for key in key_list:
            dtype = grad_dtype if key == GRADIENT_KEY else torch.float32
            rand_value = torch.rand(param_shape, dtype=dtype, device=model.device)
            dist.broadcast(rand_value, src=0, group=group)
            param_values[n][key] = rand_value
    return param_values


def set_param_values_with_dict(model, value_dict):
    for n, lp in model.named_parameters():
        for key, value_tensor in value_dict[n].items():
            if key == GRADIENT_KEY:
                safe_set_full_grad(lp, value_tensor)
            elif key == WEIGHT_KEY:
                safe_set_full_fp32_param(lp, value_tensor)
            else:
                safe_set_full_optimizer_state(lp, value_tensor, key)


def update_param_values_with_dict(model, value_dict):
    new_grad_values = {}
    for n, lp in model.named_parameters():
        if GRADIENT_KEY in value_dict[n]:
            new_grad_values[id(lp)] = value_dict[n][GRADIENT_KEY]

    def update_gradient_callback(old_value, param):
        return new_grad_values[id(param)]

    update_param_list = []
    for n, lp in model.named_parameters():
        for key, value_tensor in value_dict[n].items():
            if key == GRADIENT_KEY:
                update_param_list.append(lp)

    if len(update_param_list) > 0:
        safe_update_full_grad_vectorized(update_param_list, update_gradient_callback)


def validate_param_values_with_dict(model, value_dict):
    for n, lp in model.named_parameters():
        for key, expected_tensor in value_dict[n].items():
            if key == GRADIENT_KEY:
                actual_tensor = safe_get_full_grad(lp)
            elif key == WEIGHT_KEY:
                actual_tensor = safe_get_full_fp32_param(lp)
            else:
                actual_tensor = safe_get_full_optimizer_state(lp, key)

            assert torch.equal(expected_tensor, actual_tensor)


def create_random_values_for_local(model, key_list, group, grad_dtype):
    param_values = {}
    for n, lp in model.named_parameters():
        param_shape = lp.ds_tensor.shape
        param_values[n] = {}
        for key in key_list:
            dtype = grad_dtype if key == GRADIENT_KEY else torch.float32
            rand_value = torch.rand(param_shape, dtype=dtype, device=model.device)
            param_values[n][key] = rand_value
    return param_values


def set_local_param_values_with_dict(model, value_dict):
    for n, lp in model.named_parameters():

        for key, value_tensor in value_dict[n].items():
            if key == GRADIENT_KEY:
                safe_set_local_grad(lp, value_tensor)
            elif key == WEIGHT_KEY:
                safe_set_local_fp32_param(lp, value_tensor)
            else:
                safe_set_local_optimizer_state(lp, value_tensor, key)


def validate_local_param_values_with_dict(model, value_dict):
    for n, lp in model.named_parameters():
        for key, expected_tensor in value_dict[n].items():
            if key == GRADIENT_KEY:
                actual_tensor = safe_get_local_grad(lp)
            elif key == WEIGHT_KEY:
                actual_tensor = safe_get_local_fp32_param(lp)
            else:
                actual_tensor = safe_get_local_optimizer_state(lp, key)

            assert torch.equal(expected_tensor, actual_tensor)


helper_funcs_mapping = {
    "full": {
        "create_random_values": create_random_values,
        "set_param_values_with_dict": set_param_values_with_dict,
        "update_param_values_with_dict": update_param_values_with_dict,
        "validate_param_values_with_dict": validate_param_values_with_dict,
    },
    "local": {
        "create_random_values": create_random_values_for_local,
        "set_param_values_with_dict": set_local_param_values_with_dict,
        "validate_param_values_with_dict": validate_local_param_values_with_dict
    }
}


def test_fragments_set(tmpdir, api_type, zero_stage, offload_device, dtype):
    if not dtype in get_accelerator().supported_dtypes():
        pytest.skip(f"{get_accelerator()._name} does not support {dtype} data type")

    if dtype == torch.bfloat16 and not bf16_required_version_check(accelerator_check=False):
        pytest.skip(
            " DeepSpeed BFloat16 tests need torch >= 1.10, NCCL >= 2.10.3, CUDA > =11.0 and HW support for BFloat16 to run correctly"
        )

    if api_type == "local" and zero_stage != 3:
        pytest.skip(f"Local APIs only for zero stage 3 but current stage is {zero_stage}")

    if offload_device == OffloadDeviceEnum.nvme:
        if zero_stage != 3:
            pytest.skip(f"Nvme offload not supported for zero stage {zero_stage}")
        if not deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]:
            pytest.skip('Skip tests since async-io is not compatible')

    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-6
            }
        },
        "zero_optimization": {
            "stage": zero_stage,
        }
    }

    if offload_device == OffloadDeviceEnum.cpu:
        config_dict["zero_optimization"]["offload_optimizer"] = {"device": offload_device}
    elif offload_device == OffloadDeviceEnum.nvme:
        config_dict["zero_optimization"]["offload_optimizer"] = {
            "device": offload_device,
            "nvme_path": str(tmpdir)
        }

    if dtype == torch.float16:
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == torch.bfloat16:
        config_dict["bf16"] = {"enabled": True}

    hidden_dim = int(math.sqrt(MIN_SWAPPABLE_BYTES))
    if zero_stage == 3:
        config_dict["zero_optimization"]["param_persistence_threshold"] = hidden_dim
        with deepspeed.zero.Init(config_dict_or_path=config_dict):
            model = SimpleModel(hidden_dim)
    else:
        model = SimpleModel(hidden_dim)

    world = dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))

    dist.barrier()

    def after_bwd_validate_func(model):
        state_keys = [WEIGHT_KEY, GRADIENT_KEY]
        helper_funcs = helper_funcs_mapping[api_type]
        optim_state_values = helper_funcs["create_random_values"](model, state_keys, group, grad_dtype=dtype)
        helper_funcs["set_param_values_with_dict"](model, optim_state_values)
        helper_funcs["validate_param_values_with_dict"](model, optim_state_values)

    def after_step_validate_func(model):
        state_keys = [WEIGHT_KEY, FIRST_ORDER_KEY, SECOND_ORDER_KEY]
        helper_funcs = helper_funcs_mapping[api_type]
        optim_state_values = helper_funcs["create_random_values"](model, state_keys, group, grad_dtype=dtype)
        helper_funcs["set_param_values_with_dict"](model, optim_state_values)
        helper_funcs["validate_param_values_with_dict"](model, optim_state_values)

    run_fragmented_model(model, config_dict, hidden_dim, dtype, after_bwd_validate_func, after_step_validate_func)


def test_fragments_update(tmpdir, torch_adam, zero_stage, offload_device, dtype):
    if not dtype in get_accelerator().supported_dtypes():
        pytest.skip(f"{get_accelerator()._name} does not support {dtype} data type")

    if offload_device == OffloadDeviceEnum.nvme:
        if zero_stage != 3:
            pytest.skip(f"Nvme offload not supported for zero stage {zero_stage}")
        if not deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]:
            pytest.skip('Skip tests since async-io is not compatible')

    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-6,
                "torch_adam": torch_adam
            }
        },
        "zero_optimization": {
            "stage": zero_stage,
        }
    }

    if offload_device == OffloadDeviceEnum.cpu:
        config_dict["zero_optimization"]["offload_optimizer"] = {"device": offload_device}
    elif offload_device == OffloadDeviceEnum.nvme:
        config_dict["zero_optimization"]["offload_optimizer"] = {
            "device": offload_device,
            "nvme_path": str(tmpdir)
        }

    if dtype == torch.float16:
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == torch.bfloat16:
        config_dict["bf16"] = {"enabled": True}

    hidden_dim = int(math.sqrt(MIN_SWAPPABLE_BYTES))
    if zero_stage == 3:
        config_dict["zero_optimization"]["param_persistence_threshold"] = hidden_dim
        with deepspeed.zero.Init(config_dict_or_path=config_dict):
            model = SimpleModel(hidden_dim)
    else:
        model = SimpleModel(hidden_dim)

    world = dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))

    dist.barrier()

    api_type = "full"

    def after_bwd_validate_func(model):
        state_keys = [GRADIENT_KEY]
        helper_funcs = helper_funcs_mapping[api_type]
        optim_state_values = helper_funcs["create_random_values"](model, state_keys, group, grad_dtype=dtype)
        helper_funcs["update_param_values_with_dict"](model, optim_state_values)
        helper_funcs["validate_param_values_with_dict"](model, optim_state_values)

    def after_step_validate_func(model):
        pass

    run_fragmented_model(model, config_dict, hidden_dim, dtype, after_bwd_validate_func, after_step_validate_func)
