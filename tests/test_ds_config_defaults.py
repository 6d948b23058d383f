"""A config that spells out DeepSpeed's default for a key ringzero refuses runs: only a value that asks
for the missing feature is refused.

    python -m pytest -q tests/test_ds_config_defaults.py

Every refused key of the table (zero_keys.KEY_STATUS) is given DeepSpeed 0.19.8's default (its
config classes' values, read from DeepSpeedConfig({"train_batch_size": 1}); keys DeepSpeed removed
get their last default) and must load, except the keys DeepSpeed removed: 0.19.8 raises on them
whatever their value, and so does ringzero; a key refused without an entry here fails the walk. Then
the values that do ask for something are still refused, and data_types.grad_accum_dtype equal to
the model's dtype (what the engine accumulates in), or fp32 under bf16 at stages 1-2, runs.
"""
import warnings

import pytest

from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.key_status import GONE, R
from zero_from_scratch.engine.zero_keys import KEY_STATUS

OFF = {
    "amp": {"enabled": False, "opt_level": "O1"},
    "torch_autocast": {"enabled": False, "dtype": None, "lower_precision_safe_modules": None},
    "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
    "comet": {"enabled": False, "samples_log_interval": 100},
    "autotuning": {"enabled": False, "metric": "throughput", "fast": True},
    "elasticity": {"enabled": False},
    "data_efficiency": {"enabled": False, "seed": 1234},
    "curriculum_learning": {"enabled": False},
    "data_types": {"grad_accum_dtype": None},
    "datastates_ckpt": {"enabled": False, "config": None},
    "compile": {"deepcompile": False, "free_activation": False},
    "compression_training": {},
    "eigenvalue": {"enabled": False, "verbose": False, "max_iter": 100},
    "expert_parallel": {"enabled": False, "autoep_size": 1},
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1},
    "tensor_parallel": {"autotp_size": 0, "tp_overlap_comm": False},
    "weight_quantization": None,
    "graph_harvesting": False, "nebula": {"enabled": False}, "quantize_training": {"enabled": False},
    "progressive_layer_drop": {"enabled": False, "theta": 0.5, "gamma": 0.001},
    "sparse_attention": None, "sparse_gradients": False,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.bf16_master_weights_and_grads": False, "bf16.bf16_optimizer_states": False,
    "checkpoint.load_universal": False,
    "zero_optimization.offload_optimizer.super_offload": False,
    "zero_optimization.zenflow": None, "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.mics_shard_size": -1, "zero_optimization.mics_hierarchical_params_gather": False,
    "zero_optimization.zeropp_loco_param": None,
}


def _cfg(key, value, **extra):
    cfg = {"train_batch_size": 2, **extra}
    *path, last = key.split(".")
    d = cfg
    for p in path:
        d = d.setdefault(p, {})
    d[last] = value
    if key.startswith("zero_optimization.offload_optimizer"):
        cfg["zero_optimization"].update(stage=2, offload_optimizer={"device": "cpu", last: value})
    return cfg


def _load(cfg):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = load_config(cfg, 2)
    return out, " ".join(str(m.message) for m in w)


def test_every_refused_key_at_deepspeeds_default_loads():
    refused = sorted(k for k, v in KEY_STATUS.items() if v.startswith(R))
    assert [k for k in refused if k not in OFF] == []       # a new refused key needs its DeepSpeed default here
    for key in refused:
        if GONE in KEY_STATUS[key]:
            with pytest.raises(ValueError, match="removed from DeepSpeed"):
                _load(_cfg(key, OFF[key]))
        else:
            _load(_cfg(key, OFF[key]))


@pytest.mark.parametrize("key,value", [("amp", {"enabled": True}), ("tensor_parallel", {"autotp_size": 2}),
                                       ("zero_optimization.mics_shard_size", 2),
                                       ("bf16.bf16_optimizer_states", True), ("wandb", {"enabled": True}),
                                       ("zero_optimization.zenflow", {"overlap_step": False}),   # present: on
                                       ("data_efficiency", {"data_routing": {"random_ltd": {"enabled": True}}}),
                                       ("data_efficiency", {"data_sampling": {"enabled": True}})])
def test_a_value_that_asks_for_the_feature_is_still_refused(key, value):
    with pytest.raises(ValueError, match="is refused"):
        _load(_cfg(key, value))


def test_grad_accum_dtype_equal_to_the_models_runs_and_another_is_refused_or_warned():
    _load(_cfg("data_types.grad_accum_dtype", "fp32"))
    _load(_cfg("data_types.grad_accum_dtype", "bf16", bf16={"enabled": True}, zero_optimization={"stage": 2}))
    _load(_cfg("data_types.grad_accum_dtype", "fp32", bf16={"enabled": True}, zero_optimization={"stage": 1}))
    with pytest.raises(ValueError, match="served here only"):
        _load(_cfg("data_types.grad_accum_dtype", "fp32", fp16={"enabled": True}, zero_optimization={"stage": 1}))
    cfg, _ = _load(_cfg("data_types.grad_accum_dtype", "fp32", bf16={"enabled": True}, zero_optimization={"stage": 3}))
    assert any("ZeRO-3 ignores it" in n for n in cfg.zero.notes)


def _world_sizes(rank, world):
    import torch.distributed as dist
    from zero_from_scratch.as_deepspeed.config_objects import DeepSpeedConfig
    groups = [dist.new_group([r]) for r in range(world)]

    class Mesh:                       # torch's DeviceMesh API: the data-parallel group of this rank
        def get_group(self, mesh_dim):
            assert mesh_dim == "data_parallel"
            return groups[rank]

    class SequenceMpu:                # an mpu with only a sequence-parallel size (DeepSpeed's Ulysses case)
        def get_sequence_parallel_world_size(self):
            return world

    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    return [DeepSpeedConfig(base).train_batch_size, DeepSpeedConfig({**base, "sequence_parallel_size": world}).world_size,
            DeepSpeedConfig(base, mesh_device=Mesh()).train_batch_size, DeepSpeedConfig(base, mpu=SequenceMpu()).world_size]


def test_deepspeed_config_takes_its_world_size_as_deepspeed_does(spawn):
    """mesh_device and sequence_parallel_size divide the data-parallel size (runtime/config.py's
    order), so the batch sizes follow; the engine refuses sequence_parallel_size > 1 without an mpu."""
    for got in spawn(_world_sizes, 2):
        assert got == [4, 1, 2, 1]
    _load(_cfg("sequence_parallel_size", 1))
    with pytest.raises(ValueError, match="Ulysses"):
        _load(_cfg("sequence_parallel_size", 2))
