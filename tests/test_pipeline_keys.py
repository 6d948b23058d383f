"""Nothing silent in the pipeline engine's config: what its KEY_STATUS refuses raises naming the key,
what it warns warns, and the sections it honours act (csv_monitor files hold the losses train_batch
returned; steps_per_print prints DeepSpeed's pipeline line)."""
import csv
import os
import warnings
from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn as nn

from pipeline_parallel.engine.config import KEY_STATUS, load
from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.engine.config import build_optimizer
from primitives.log import console
from zero_from_scratch.engine.client_optim import OptimizerConfig

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


@pytest.mark.parametrize("extra, match", [
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "'zero_optimization.offload_optimizer'.*is refused at stage 0: DeepSpeed offloads only a ZeRO optimizer"),
    ({"gradient_allreduce_op": "sum"}, "'gradient_allreduce_op' = 'sum' is refused"),
    ({"zero_optimization": {"stage": 2}}, "ZeRO-2/3 do not combine with pipeline parallelism"),
    ({"bf16": {"enabled": True}, "pipeline": {"clip_norm": "stage0"}}, "'pipeline.clip_norm' = 'stage0' with bf16"),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "eps": 1e-8}}}, "optimizer.params.eps.*not Lion's"),
    ({"checkpoint": {"load_universal": True}}, "'checkpoint.load_universal' = True is refused: not done by the "
     "pipeline engine; DeepSpeed's pipeline engine would load_checkpoint from ds_to_universal's folder"),
])
def test_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        load({**BASE, **extra}, dp=1)


@pytest.mark.parametrize("extra, match", [
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing = .*activation_checkpoint_interval"),
    ({"comms_logger": {"enabled": True}}, "comms_logger = .*engine.step_bytes"),
    ({"wall_clock_breakdown": True}, "wall_clock_breakdown = True"),
    ({"fp16": {"enabled": True, "hysteresis": 2}}, "fp16.hysteresis = 2.*no hysteresis"),
    ({"zero_optimization": {"stage": 0, "reduce_bucket_size": 5}}, "reduce_bucket_size = 5: no effect"),
])
def test_warned(extra, match):
    with pytest.warns(UserWarning, match=match):
        load({**BASE, **extra}, dp=1)


def test_honoured_sections_load_quietly_and_the_table_says_why():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load({**BASE, "tensorboard": {"enabled": False}, "csv_monitor": {"enabled": True, "output_path": "x"},
                    "steps_per_print": 5, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, dp=1)
    assert cfg.lion == {"lr": 1e-4, "betas": (0.9, 0.999), "weight_decay": 0.0}
    for k in ("tensorboard.enabled", "csv_monitor.output_path", "steps_per_print", "fp16.initial_scale_power"):
        assert KEY_STATUS[k].startswith("honoured"), k
    assert KEY_STATUS["zero_optimization.offload_optimizer"].startswith("refused when not stage 1")
    load({**BASE, "checkpoint": {"load_universal": False}}, dp=1)    # DeepSpeed's default: nothing asked for


def _monitored(rank, world, out):
    torch_layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)]
    net = PipelineModule(torch_layers, num_stages=2, loss_fn=nn.functional.cross_entropy, partition_method=[2, 1])
    cfg = {**BASE, "steps_per_print": 2, "csv_monitor": {"enabled": True, "output_path": out, "job_name": "pipe"}}
    engine = initialize(model=net, config=cfg)[0]
    data = [(torch.randn(2, 6), torch.randint(0, 3, (2,))) for _ in range(8)]
    with console.capture() as cap:
        losses = [float(engine.train_batch(iter(data[2 * t:2 * t + 2]))) for t in range(4)]
    return losses, cap.get()


def test_csv_monitor_and_steps_per_print_act(spawn, tmp_path):
    (losses, text), _ = spawn(_monitored, 2, args=(str(tmp_path),))
    with open(os.path.join(tmp_path, "pipe", "Train_Samples_train_loss.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [4, 8, 12, 16]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
    assert text.count("steps: ") == 2 and "steps: 2 loss: " in text and "steps: 4 loss: " in text


def test_optimizers_the_pipeline_engine_does_not_build_are_refused():
    """The shared config reader accepts SGD/Adagrad and bias_correction for the ZeRO engine; the
    pipeline engine builds torch's Adam/AdamW/SGD (or Lion), so anything else is refused at start-up."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    for opt, words in ((OptimizerConfig(type="Adagrad"), "'Adagrad'"),
                       (OptimizerConfig(type="AdamW", bias_correction=False), "bias_correction false")):
        with pytest.raises(ValueError, match=words):
            build_optimizer(NS(run=NS(optimizer=opt), lion=None), params, None, 0)
    built = build_optimizer(NS(run=NS(optimizer=OptimizerConfig(type="AdamW")), lion=None), params, None, 0)
    assert isinstance(built, torch.optim.AdamW)
    sgd = build_optimizer(NS(run=NS(optimizer=OptimizerConfig(type="SGD", params={"lr": 0.5})), lion=None), params,
                          None, 0)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.5   # DeepSpeed's torch.optim.SGD
