"""Every tensor of a pipeline step lives on the stage's device: boundary buffers, headers, the loss,
the status all-reduce, ZeRO-1's flat gradients and gathered parameters (its shard and optimizer
in host memory only when offloaded).

    python -m pytest -q tests/test_pipeline_device.py            (the CUDA tests skip without GPUs)

On this CPU machine the check is an audit: a torch function mode records every factory call
(torch.zeros, empty, tensor, full, …) made from the engine's files without a device argument —
on a GPU each one would be a host tensor handed to nccl, which fails. With 2 (4) GPUs the llama
pipeline trains under nccl at pp = 2 (pp × dp = 2 × 2, ZeRO-1 with and without offload) with
every schedule, and its losses equal the same run on CPU over gloo.
"""
import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.models import llama_layers, llama_loss, llama_model

SEQ, B, M, STEPS = 16, 2, 4, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTORIES = {torch.zeros, torch.empty, torch.ones, torch.full, torch.tensor, torch.arange, torch.randn,
             torch.rand, torch.randint, torch.as_tensor}
SCHEDULES = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


class HostAllocations(TorchFunctionMode):
    """Records factory calls without device= whose caller is a file of the engine (pipeline_parallel/)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            for f in reversed(traceback.extract_stack()[:-1]):
                if f.filename.startswith(os.path.join(ROOT, "pipeline_parallel")):
                    self.found.append(f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {func.__name__}")
                    break
        return func(*args, **kwargs)


def batch(step, mb):
    g = torch.Generator().manual_seed(1000 * step + mb)
    ids = torch.randint(0, 256, (B, SEQ), generator=g)
    return ids, ids.clone()


def config(schedule="1f1b", v=1, zero=0, offload=False, bf16=False):
    z = {"stage": zero, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
            "zero_optimization": z, "bf16": {"enabled": bf16}, "gradient_clipping": 1.0,
            "pipeline": {"schedule": schedule, "virtual_stages": v},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}}}


def _train(cfg, pp=2):
    net = PipelineModule(llama_layers(llama_model("tiny").train()), num_stages=pp, loss_fn=llama_loss,
                         partition_method="uniform")
    engine = initialize(model=net, config=cfg)[0]
    d = engine.dp_rank
    losses = [engine.train_batch(iter([batch(t, d * M + i) for i in range(M)])) for t in range(STEPS)]
    losses.append(engine.eval_batch(iter([batch(99, d * M + i) for i in range(M)])))
    return engine, losses


def _audit(rank, world, runs):
    out = []
    for kw in runs:
        net = PipelineModule(llama_layers(llama_model("tiny").train()), num_stages=2, loss_fn=llama_loss,
                             partition_method="uniform")
        engine = initialize(model=net, config=config(**kw))[0]       # construction may allocate on the host
        with HostAllocations() as mode:
            for t in range(STEPS):
                engine.train_batch(iter([batch(t, i) for i in range(M)]))
            engine.eval_batch(iter([batch(99, i) for i in range(M)]))
        out.append(sorted(set(mode.found)))
    return out


@pytest.mark.slow
def test_no_step_allocates_on_the_host_without_naming_a_device(spawn):
    """pp = 2, bf16 interleaved with ZeRO-1: the executor, the draining guards, the status
    all-reduce and ZeRO-1 name the stage's device for every tensor they create in a step."""
    runs = [dict(schedule="interleaved", v=2, zero=1, bf16=True)]
    for rank, found in enumerate(spawn(_audit, 2, args=(runs,))):
        assert found == [[]], (rank, found)


def _cuda(rank, world, runs):
    out = []
    for kw in runs:
        engine, losses = _train(config(**kw))
        dev = torch.device("cuda", rank)
        assert engine.device == dev and all(t.device == dev for t in losses)
        assert all(p.device == dev for p in engine.params)
        if engine.zero1 is not None:
            want = torch.device("cpu") if kw.get("offload") else dev
            assert engine.zero1.master.device.type == want.type
        out.append([float(x) for x in losses])
    return out


def _cpu(rank, world, runs):
    return [[float(x) for x in _train(config(**kw))[1]] for kw in runs]


def _equal_to_cpu(spawn, world, runs):
    gpu = spawn(_cuda, world, args=(runs,), backend="nccl", timeout=600)
    cpu = spawn(_cpu, world, args=(runs,), timeout=600)
    for rank in range(world):
        for kw, g, c in zip(runs, gpu[rank], cpu[rank]):
            # one device's kernels against another's: fp32 sums in a different order, ~1e-6 relative
            tol = 2e-2 if kw.get("bf16") else 1e-4
            assert g == pytest.approx(c, rel=tol), (kw, g, c)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs one GPU per rank: 2 GPUs")
def test_pp2_trains_on_gpus_with_every_schedule(spawn):
    runs = [dict(schedule=s, v=v) for s, v in SCHEDULES] + [dict(schedule="1f1b", bf16=True, zero=1)]
    _equal_to_cpu(spawn, 2, runs)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="nccl needs one GPU per rank: 4 GPUs")
def test_pp2_dp2_trains_on_gpus_with_zero1_and_offload(spawn):
    runs = [dict(schedule=s, v=v, zero=1) for s, v in SCHEDULES] + [dict(schedule="1f1b", zero=1, offload=True)]
    _equal_to_cpu(spawn, 4, runs)
