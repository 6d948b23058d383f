"""DeepSpeed's checkpoint unit-test bodies (tests/unit/checkpoint/), as plain functions (harness.py).

    python -m tests.ds_unit.harness test_existing_latest test_checkpoint_fp32_optimizer

Upstream, at deepspeedai/DeepSpeed commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (Apache-2.0,
Copyright (c) Microsoft Corporation, DeepSpeed Team):
  test_latest_checkpoint.py  TestLatestCheckpoint.test_existing_latest / test_missing_latest
  test_other_optimizer.py    TestOtherOptimizerCheckpoint.test_checkpoint_fp32_optimizer
(test_zero_optimizer.py's bodies: checkpoint_zero_bodies.py)
Each method is a module function of the same name (no self; the parametrization is in selection.py);
the bodies are unchanged. Imports: upstream's (`unit.` → `tests.ds_unit.`), less the FusedAdamBuilder
module-level skip (harness-level: the CPU build of fused_adam is compatible). Cost: checkpoint_common's.
"""
import deepspeed

from tests.ds_unit.simple_model import *
from tests.ds_unit.checkpoint_common import checkpoint_correctness_verification
from deepspeed.accelerator import get_accelerator

import pytest


def test_existing_latest(tmpdir):
    config_dict = {
        "train_batch_size": 2,
        "steps_per_print": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.00015
            }
        }
    }
    hidden_dim = 10
    models = [SimpleModel(hidden_dim=hidden_dim) for _ in range(2)]
    checkpoint_correctness_verification(config_dict=config_dict,
                                        models=models,
                                        hidden_dim=hidden_dim,
                                        tmpdir=tmpdir,
                                        load_optimizer_states=True,
                                        load_lr_scheduler_states=False,
                                        empty_tag=True,
                                        dtype=torch.float)


def test_missing_latest(tmpdir):
    config_dict = {
        "train_batch_size": 2,
        "steps_per_print": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.00015
            }
        }
    }
    hidden_dim = 10
    model = SimpleModel(hidden_dim)
    model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, model_parameters=model.parameters())
    # should be no-op, since latest doesn't exist
    model.load_checkpoint(tmpdir)


def test_checkpoint_fp32_optimizer(tmpdir):
    config_dict = {
        "train_batch_size": 2,
        "steps_per_print": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.00015,
                "betas": [0.8, 0.999],
                "eps": 1e-8,
                "weight_decay": 3e-7
            }
        },
        "fp16": {
            "enabled": False
        }
    }

    args = args_from_dict(tmpdir, config_dict)
    hidden_dim = 10
    models = [SimpleModel(hidden_dim, empty_grad=False) for _ in range(2)]
    checkpoint_correctness_verification(config_dict,
                                        models=models,
                                        hidden_dim=hidden_dim,
                                        tmpdir=tmpdir,
                                        dtype=torch.float32)
