"""DeepSpeed's tests/unit/checkpoint/test_zero_optimizer.py bodies that run on CPU, as plain functions (harness.py).

    python -m tests.ds_unit.harness test_load_optimizer_state test_immediate_save_load

Upstream: deepspeedai/DeepSpeed tests/unit/checkpoint/test_zero_optimizer.py at commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (Apache-2.0, Copyright (c) Microsoft Corporation, DeepSpeed Team):
TestZeROCheckpoint.test_pipeline_checkpoint_loading / test_load_optimizer_state / test_not_load_optimizer_state /
test_hybrid_optimizer_state / test_load_module_only; TestZeROSaveLoadEdgeCase.test_immediate_save_load /
test_save_before_accum_grad_is_done. Each method is a module function of the same name (no self; the
parametrization is in selection.py); the bodies are unchanged. Imports: upstream's (`unit.` →
`tests.ds_unit.`), less the names no ported body uses. Cost: checkpoint_common's, per body.
"""
import deepspeed

from tests.ds_unit.simple_model import *
from tests.ds_unit.checkpoint_common import *
from deepspeed.accelerator import get_accelerator

import pytest


def test_pipeline_checkpoint_loading(tmpdir, zero_stage):
    config_dict = {
        "train_batch_size": 2,
        "optimizer": {
            "type": 'Adam'
        },
        "zero_optimization": {
            "stage": zero_stage,
            "pipeline_loading_checkpoint": True,
        }
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    hidden_dim = 10

    with deepspeed.zero.Init(config_dict_or_path=config_dict):
        models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]

    checkpoint_correctness_verification(config_dict, models, hidden_dim, tmpdir, load_module_only=True)


def test_load_optimizer_state(tmpdir, zero_stage, use_cpu_offload, adam_optimizer):
    if use_cpu_offload and not deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]:
        pytest.skip("cpu-adam is not compatible")

    config_dict = {
        "train_batch_size": 2,
        "steps_per_print": 1,
        "optimizer": {
            "type": 'Adam',
            "params": {
                "lr": 0.00015,
                "betas": [0.8, 0.999],
                "eps": 1e-8,
                "weight_decay": 3e-7
            }
        },
        "wall_clock_breakdown": True,
        "zero_optimization": {
            "stage": zero_stage,
            "cpu_offload": use_cpu_offload
        }
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    hidden_dim = 10

    if zero_stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config_dict):
            models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]
    else:
        models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]

    checkpoint_correctness_verification(config_dict, models, hidden_dim, tmpdir, load_optimizer_states=True)


def test_not_load_optimizer_state(tmpdir, zero_stage, use_cpu_offload, adam_optimizer):
    if use_cpu_offload and not deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]:
        pytest.skip("cpu-adam is not compatible")

    config_dict = {
        "train_batch_size": 2,
        "steps_per_print": 1,
        "optimizer": {
            "type": 'Adam',
            "params": {
                "lr": 0.00015,
                "betas": [0.8, 0.999],
                "eps": 1e-8,
                "weight_decay": 3e-7
            }
        },
        "zero_optimization": {
            "stage": zero_stage,
            "cpu_offload": use_cpu_offload
        }
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    hidden_dim = 10

    if zero_stage == 3:
        global DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        with deepspeed.zero.Init(config_dict_or_path=config_dict):
            models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]
    else:
        models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]

    checkpoint_correctness_verification(config_dict, models, hidden_dim, tmpdir, load_optimizer_states=False)


def test_hybrid_optimizer_state(tmpdir, zero_stage):
    config_dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "zero_optimization": {
            "stage": zero_stage
        },
        "zero_allow_untested_optimizer": True,
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    hidden_dim = 10
    models = [SimpleModel(hidden_dim=hidden_dim) for _ in range(2)]
    optimizers = [HybridStateOptimizer(model.parameters()) for model in models]

    checkpoint_correctness_verification(config_dict,
                                        models=models,
                                        base_optimizers=optimizers,
                                        hidden_dim=hidden_dim,
                                        tmpdir=tmpdir,
                                        load_optimizer_states=True)


def test_load_module_only(tmpdir, zero_stage):
    if zero_stage == 0 and get_accelerator().device_name() == "cpu":
        pytest.skip("CPU Accelerator does not support this test")
    config_dict = {
        "train_batch_size": 2,
        "optimizer": {
            "type": 'Adam'
        },
        "zero_optimization": {
            "stage": zero_stage,
        }
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    hidden_dim = 10

    if zero_stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config_dict):
            models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]
    else:
        models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]

    checkpoint_correctness_verification(config_dict, models, hidden_dim, tmpdir, load_module_only=True)


def test_immediate_save_load(tmpdir, zero_stage):
    config_dict = {
        "train_batch_size": 4,
        "optimizer": {
            "type": 'Adam'
        },
        "zero_optimization": {
            "stage": zero_stage,
        }
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    hidden_dim = 10
    model = SimpleModel(hidden_dim)

    ds_model = create_deepspeed_model(config_dict=config_dict, model=model, base_optimizer=None)
    ds_model.save_checkpoint(tmpdir)
    ds_model.load_checkpoint(tmpdir,
                             load_optimizer_states=False,
                             load_lr_scheduler_states=False,
                             load_module_only=False)


def test_save_before_accum_grad_is_done(tmpdir, zero_stage):
    config_dict = {
        "optimizer": {
            "type": 'Adam'
        },
        "zero_optimization": {
            "stage": zero_stage,
            "stage3_gather_fp16_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 4,
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
    hidden_dim = 10
    model = SimpleModel(hidden_dim)

    # This test reproduces a bug where one tries to retrieve a 16bit model before grad_accum
    # cycle was completed.
    # So we config grad_accum=2 and step only once and save_16bit_model
    ds_model = create_deepspeed_model(config_dict=config_dict, model=model, base_optimizer=None)

    data_loader = random_dataloader(model=ds_model, total_samples=2, hidden_dim=hidden_dim, device=ds_model.device)

    batch = next(iter(data_loader))
    loss = ds_model(batch[0], batch[1])
    ds_model.backward(loss)
    ds_model.step()

    ds_model.empty_partition_cache()

    # we stepped only once, and now save 16bit model before gradient_accumulation_steps=2 is complete
    ds_model.save_16bit_model(tmpdir, "model.pt")

    # let's test just as well that we can save the checkpoint too
    ds_model.save_checkpoint(tmpdir)
