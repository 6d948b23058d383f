"""ZeRO engine start-up: DeepSpeed's config spellings and defaults, read as DeepSpeed 0.19.8 reads
them (its own parser is the reference), and every rank starting from rank 0's parameters and
buffers (frozen ones included), as deepspeed.initialize and torch DDP do."""
import os
import warnings

import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.config import load_config

SPELLINGS = [
    {"optimizer": {"type": "adamw", "params": {"lr": 1e-3}}},
    {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}},       # weight decay: torch AdamW's 0.01
    {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}},
    {"optimizer": {"type": "ADAM", "params": {"lr": 1e-3}}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "offload_param": None}},
    {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 10, "param_persistence_threshold": 0}},
    {"zero_optimization": {"stage": 1, "cpu_offload": False}},
    {"zero_optimization": True},
    {"bfloat16": {"enabled": True}},
    {},                                                         # every default, gradient_clipping included
]


def _ours(raw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # a spelling DeepSpeed accepts is no unknown key
        c = load_config({"train_batch_size": 4, **raw}, world_size=1)
    return c.optimizer.type.lower(), c.bf16, c.zero.stage, c.gradient_clipping, False, c.optimizer.weight_decay


def _deepspeed(raw):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig
    c = DeepSpeedConfig({"train_batch_size": 4, **raw})
    z = c.zero_config
    off = any(o is not None and o.device != "none" for o in (z.offload_optimizer, z.offload_param))
    return ((c.optimizer_name or "adamw").lower(), bool(c.bfloat16_config.enabled), int(c.zero_optimization_stage),
            float(c.gradient_clipping), off, _ds_weight_decay(c))


def _ds_weight_decay(c):
    """The weight decay the optimizer class DeepSpeed would build applies (its constructor default)."""
    import inspect
    import torch
    from deepspeed.ops.adam import FusedAdam
    p = dict(c.optimizer_params or {})
    if "weight_decay" in p:
        return p["weight_decay"]
    adamw = (c.optimizer_name or "adamw") == "adamw" or p.get("adam_w_mode", True)
    cls = (torch.optim.AdamW if adamw else torch.optim.Adam) if p.get("torch_adam") else FusedAdam
    return inspect.signature(cls.__init__).parameters["weight_decay"].default


@pytest.mark.deepspeed
def test_spellings_and_defaults_read_as_deepspeed_reads_them():
    pytest.importorskip("deepspeed")
    for raw in SPELLINGS:
        assert _ours(raw) == _deepspeed(raw), raw


def test_offload_spellings_and_bad_type_named(tmp_path):
    # optimizer offload (offload.py) at any stage, parameter offload (param_offload.py) at stage 3; the old flags refused
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}, "offload_param": {"device": "none"}}}, 1)
    assert cfg.offload_optimizer == {"device": "nvme", "nvme_path": str(tmp_path)}
    assert load_config({"train_batch_size": 2, "zero_optimization": {"offload_optimizer": False}}, 1).offload_optimizer is None
    with pytest.raises(ValueError, match=r"offload_param' needs stage 3 \(got stage 0\)"):
        load_config({"train_batch_size": 2, "zero_optimization": {"offload_param": {"device": "cpu"}}}, 1)
    with pytest.raises(ValueError, match=r"cpu_offload=true"):
        load_config({"train_batch_size": 2, "zero_optimization": {"cpu_offload": True}}, 1)
    with pytest.raises(ValueError, match=r"'optimizer.type' = 'sgd'"):
        load_config({"train_batch_size": 2, "optimizer": {"type": "sgd"}}, 1)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.emb.weight.requires_grad_(False)                  # frozen: not sharded, still must agree
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, ids):
        return self.bn(self.fc(self.emb(ids)))


def _start(rank, world, stage):
    torch.manual_seed(100 + rank)                               # every rank builds a different model
    model = Frozen()
    model.bn.running_mean.fill_(float(rank + 1))
    model.bn.num_batches_tracked.fill_(rank + 5)
    e, *_ = zero_from_scratch.initialize(model=model, config={"train_batch_size": 2 * world,
                                                              "zero_optimization": {"stage": stage}})
    with e.gathered_parameters(list(model.parameters())):
        return {k: v.tolist() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 3])
def test_parameters_and_buffers_start_from_rank_0(spawn, stage):
    torch.manual_seed(100)
    want = Frozen()
    want.bn.running_mean.fill_(1.0)
    want.bn.num_batches_tracked.fill_(5)
    for r, got in enumerate(spawn(_start, 2, args=(stage,))):
        assert set(got) == set(want.state_dict())
        for k, v in want.state_dict().items():
            assert torch.equal(torch.tensor(got[k], dtype=v.dtype), v), (r, k)


def test_unknown_keys_are_recorded_and_warned():
    # a typo is listed in unknown_keys (not swallowed by another field) and warned once, with a suggestion
    with pytest.warns(UserWarning, match=r"gradient_cliping \(did you mean 'gradient_clipping'\?\)"):
        cfg = load_config({"train_batch_size": 2, "gradient_cliping": 0.5}, 1)
    assert cfg.unknown_keys == ["gradient_cliping"] and cfg.monitor == {}


def test_engine_config_reads_by_key_like_deepspeeds_dict():
    """DeepSpeed's engine.config is the (auto-resolved) JSON dict; the HF Trainer reads
    engine.config.get("zero_optimization", {}).get("stage") when it saves a checkpoint."""
    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                       "zero_optimization": {"stage": 3}}, world_size=2)
    assert cfg.get("zero_optimization", {}).get("stage") == 3
    assert cfg["train_micro_batch_size_per_gpu"] == 4          # "auto" resolved, as DeepSpeed's dict holds it
    assert cfg.get("tensor_parallel", {}) == {}
