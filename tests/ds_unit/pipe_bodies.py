"""DeepSpeed's tests/unit/runtime/pipe/test_pipe.py bodies that run on CPU, as plain functions (harness.py).

    python -m tests.ds_unit.harness test_gradients_are_scaled_once

Upstream: deepspeedai/DeepSpeed tests/unit/runtime/pipe/test_pipe.py at commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (Apache-2.0, Copyright (c) Microsoft Corporation, DeepSpeed Team).
TestPipeGradientAccumulationScaling.test_gradients_are_scaled_once → test_gradients_are_scaled_once;
TestPipeDynamicShape.test_pipe_base → test_pipe_dynamic_shape (its topo_config a parameter given by
selection.py, sized for 2 ranks). Left out: TestPipeCifar10 (AlexNet on CIFAR-10, 100 steps, needs
the data set and a GPU: skip_on_arch). Bodies unchanged apart from self. Cost: a few pipeline steps.
"""
import copy
import torch.nn as nn
import pytest

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.utils import RepeatingLoader
from tests.ds_unit.util import no_child_process_in_deepspeed_io

PipeTopo = PipeDataParallelTopology

config_dict = {
    "train_batch_size": 4,
    "grandient_accumulation_steps": 1,
    "steps_per_print": 20,
    "optimizer": {
        "type": "Adam",
        "params": {
            "lr": 0.001,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 3e-7
        }
    },
    "zero_optimization": {
        "stage": 0
    },
    "fp16": {
        "enabled": False
    },
    "pipeline": {
        "seed_layers": True,
        "activation_checkpoint_interval": 1
    }
}


def rel_diff(A, B):
    return abs(A - B) / abs(A)



def test_gradients_are_scaled_once():
    gas = 2
    learning_rate = 0.1
    config = {
        "train_batch_size": gas,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": learning_rate
            }
        },
        "zero_allow_untested_optimizer": True,
        "pipeline": {
            "activation_checkpoint_interval": 0
        },
    }

    layers = [nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)]
    for layer in layers:
        layer.weight.data.fill_(1.0)

    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss())
    engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
    engine.set_dataiterator(RepeatingLoader([(torch.ones(1, 1), torch.zeros(1, 1))]))

    engine.train_batch()

    expected_weight = torch.tensor([[1.0 - 2.0 * learning_rate]], device=engine.device)
    actual_weight = next(engine.module.parameters())
    assert torch.allclose(actual_weight, expected_weight)


class DynamicShapeTestLayer(nn.Module):

    def __init__(self, hidden_size):
        super().__init__()
        self.fc = nn.Linear(hidden_size, hidden_size)
        self.shapes = set()

    def forward(self, x):
        self.shapes.add(x.shape)
        y = self.fc(x)
        return y


class DynamicShapeTestModel(nn.Module):

    def __init__(self, n_layers, hidden_size):
        super().__init__()
        self.layers = nn.ModuleList([DynamicShapeTestLayer(hidden_size) for _ in range(n_layers)])


def test_pipe_dynamic_shape(topo_config):
    """This test checks if the pipeline engine can handle dynamic shapes correctly.
    We pass inputs of different shapes to the pipeline engine.
    """

    n_iter = 10
    n_layers = 4
    n_samples = 1024
    batch_size = 4
    channel_dims = [8, 16, 32, 64]
    hidden_size = 16

    topo = PipeTopo(**topo_config)

    model = DynamicShapeTestModel(n_layers, hidden_size)
    model = PipelineModule(layers=model.layers, topology=topo, loss_fn=nn.MSELoss(), dynamic_shape=True)

    # Each batch has different channel dim but we use the same channel dim in the same batch
    xs = [
        torch.randn(channel_dims[(i // batch_size) % len(channel_dims)], hidden_size, dtype=torch.float32)
        for i in range(n_samples)
    ]
    ys = [torch.randn_like(x) for x in xs]

    class CustomDataset(torch.utils.data.Dataset):

        def __init__(self, xs, ys):
            self.xs = xs
            self.ys = ys

        def __len__(self):
            return len(self.xs)

        def __getitem__(self, idx):
            return self.xs[idx], self.ys[idx]

    dataset = CustomDataset(xs, ys)

    config_dict["train_batch_size"] = batch_size

    with no_child_process_in_deepspeed_io():
        engine, _, _, _ = deepspeed.initialize(config=config_dict,
                                               model=model,
                                               model_parameters=[p for p in model.parameters()],
                                               training_data=dataset)

    for _ in range(n_iter):
        _ = engine.train_batch()

    # Check if all layers have seen different shapes
    for layer in model.modules():
        if isinstance(layer, DynamicShapeTestLayer):
            assert len(layer.shapes) > 1
