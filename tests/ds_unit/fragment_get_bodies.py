"""DeepSpeed's tests/unit/runtime/zero/test_zero_tensor_fragment.py (safe_get/set_full_*, safe_*_local_*,
safe_update_full_grad_vectorized), as plain functions (harness.py): the get half.

    python -m tests.ds_unit.harness test_fragments_get

Upstream: deepspeedai/DeepSpeed tests/unit/runtime/zero/test_zero_tensor_fragment.py at commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (Apache-2.0, Copyright (c) Microsoft Corporation, DeepSpeed Team).
TestTensorFragmentGet.test_zero_fragments → test_fragments_get (no self; the parametrization,
frozen_weights included, is in selection.py); its helpers unchanged; the set half is fragment_set_bodies.py. Left out:
test_bf16_optimizer_fragments (skipped on CPU upstream).
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


WEIGHT_KEY = 'weight'
FIRST_ORDER_KEY = 'exp_avg'
SECOND_ORDER_KEY = 'exp_avg_sq'
GRADIENT_KEY = 'gradient'


def validate_tensor(model, api_type, opt_states):
    assert api_type in ["full", "local"]
    for _, lp in model.named_parameters():
        param_list = []
        if opt_states:
            param_list.append(
                safe_get_full_optimizer_state(lp, 'exp_avg') if api_type ==
                "full" else safe_get_local_optimizer_state(lp, 'exp_avg'))
            param_list.append(
                safe_get_full_optimizer_state(lp, 'exp_avg_sq') if api_type ==
                "full" else safe_get_local_optimizer_state(lp, 'exp_avg_sq'))
        else:
            param_list.append(safe_get_full_fp32_param(lp) if api_type == "full" else safe_get_local_fp32_param(lp))
            param_list.append(safe_get_full_grad(lp) if api_type == "full" else safe_get_local_grad(lp))
        if lp.requires_grad:
            assert all([p is not None for p in param_list])
        else:
            assert all([p is None for p in param_list])


class MyModel(torch.nn.Module):

    def __init__(self, hidden_dim, frozen_weights):
        super(MyModel, self).__init__()
        self.act = torch.nn.ReLU()
        self.cel = torch.nn.CrossEntropyLoss()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(hidden_dim, 1),
             torch.nn.Linear(1, 1),
             torch.nn.Linear(1, hidden_dim)])
        if frozen_weights:
            self.linears[0].weight.requires_grad = False
            self.linears[0].bias.requires_grad = False

    def forward(self, x, y):
        for l in self.linears:
            x = l(x)
            x = self.act(x)
        return self.cel(x, y)


def run_fragmented_model(model, config_dict, hidden_dim, dtype, validate_after_bwd, validate_after_step):
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config_dict)
    data_loader = random_dataloader(model=model,
                                    total_samples=10,
                                    hidden_dim=hidden_dim,
                                    device=model.device,
                                    dtype=dtype)
    dist.barrier()
    for n, batch in enumerate(data_loader):
        loss = model(batch[0], batch[1])
        model.backward(loss)
        validate_after_bwd(model)
        model.step()
        validate_after_step(model)

    # Needed in ZeRO 3. Not doing so can give memory leak
    model.destroy()


def test_fragments_get(tmpdir, dtype, api_type, zero_stage, offload_device, frozen_weights):
    if not dtype in get_accelerator().supported_dtypes():
        pytest.skip(f"{get_accelerator()._name} does not support {dtype} data type")

    if offload_device == OffloadDeviceEnum.nvme:
        if zero_stage != 3:
            pytest.skip(f"Nvme offload not supported for zero stage {zero_stage}")
        if not deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]:
            pytest.skip('Skip tests since async-io is not compatible')

    if api_type == "local" and zero_stage != 3:
        pytest.skip(f"Local APIs only for zero stage 3 but current stage is {zero_stage}")

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

    if dtype == torch.half:
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 2}
    elif dtype == torch.bfloat16:
        config_dict["bf16"] = {"enabled": True}

    if offload_device == OffloadDeviceEnum.cpu:
        config_dict["zero_optimization"]["offload_optimizer"] = {"device": offload_device}
    elif offload_device == OffloadDeviceEnum.nvme:
        config_dict["zero_optimization"]["offload_optimizer"] = {
            "device": offload_device,
            "nvme_path": str(tmpdir)
        }

    hidden_dim = MIN_SWAPPABLE_BYTES
    if zero_stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config_dict):
            model = MyModel(hidden_dim, frozen_weights)
    else:
        model = MyModel(hidden_dim, frozen_weights)

    validate_after_bwd = lambda model: validate_tensor(model, api_type, opt_states=False)
    validate_after_step = lambda model: validate_tensor(model, api_type, opt_states=True)

    run_fragmented_model(model, config_dict, hidden_dim, dtype, validate_after_bwd, validate_after_step)
