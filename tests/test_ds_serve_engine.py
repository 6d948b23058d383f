"""The engine's DeepSpeed surface where DeepSpeed 0.19.8 differs from a first guess: which optimizer is a
ZeROOptimizer, the expert optimizer file's name, the optimizer file's ds_config, tied weights in
zero_to_fp32's outputs.

    python -m pytest -q tests/test_ds_serve_engine.py            (one rank; -m slow: DeepSpeed's engine too)

Reference: DeepSpeed 0.19.8. Its stage-0 engine wraps the optimizer in FP16_Optimizer /
FP16_UnfusedOptimizer (bf16 too), neither a ZeROOptimizer (runtime/engine.py _do_optimizer_sanity_check,
DDP_BFLOAT16); the slow test builds DeepSpeed's engines for the same configs. Its zero_to_fp32 runs here
on the checkpoint ringzero wrote (the installed package, same process).
"""
import os

import pytest
import torch
import torch.nn as nn

pytest.importorskip("deepspeed")

CONFIGS = [(0, True), (0, False), (1, True), (2, False)]     # (stage, bf16)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x)).sum()


def _cfg(stage, bf16):
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _ours(rank, world, d):
    import zero_from_scratch
    from zero_from_scratch.engine.z_ua_boundary import ZeROOptimizer
    kinds = []
    for stage, bf16 in CONFIGS:
        m = Tied()
        e, *_ = zero_from_scratch.initialize(model=m, model_parameters=m.parameters(), config=_cfg(stage, bf16))
        kinds.append(isinstance(e.optimizer, ZeROOptimizer))
    name = e._get_optimizer_ckpt_name("ck", "t", 3)
    e.backward(e(torch.ones(1, 4)))
    e.step()
    e.save_checkpoint(d, tag="t")
    return kinds, name


def _theirs(rank, world):
    from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed
    deepspeed = prepare_deepspeed()
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    kinds = []
    for stage, bf16 in CONFIGS:
        m = Tied()
        e, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_cfg(stage, bf16))
        kinds.append(isinstance(e.optimizer, ZeROOptimizer))
    return kinds, e._get_optimizer_ckpt_name("ck", "t", 3)


def test_engine_surface_and_tied_weights_in_zero_to_fp32(spawn, tmp_path):
    d = str(tmp_path / "ck")
    kinds, name = spawn(_ours, 1, args=(d,))[0]
    assert kinds == [False, False, True, True]
    assert name == os.path.join("ck", "t", "expp_rank_3_mp_rank_00_optim_states.pt")
    from zero_from_scratch.engine.checkpoint_ds import load_file
    model = load_file(f"{d}/t/mp_rank_00_model_states.pt")
    optim = load_file(f"{d}/t/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert optim["ds_config"] == model["ds_config"] and _cfg(2, False).items() <= model["ds_config"].items()
    assert model["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 1} and model["mp_world_size"] == 1
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as theirs
    from zero_from_scratch.engine.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as ours
    for side, f in (("theirs", theirs), ("ours", ours)):
        f(d, f"{tmp_path}/{side}")
        sd = torch.load(f"{tmp_path}/{side}/pytorch_model.bin")
        assert sd["a.weight"] is sd["b.weight"], side                    # tied stays tied in .bin
        with pytest.raises(RuntimeError, match="Some tensors share memory"):   # safetensors refuses, both sides
            f(d, f"{tmp_path}/{side}_safe", safe_serialization=True)
    a, b = (torch.load(f"{tmp_path}/{s}/pytorch_model.bin") for s in ("theirs", "ours"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_deepspeeds_engine_agrees(spawn, tmp_path):
    ours = spawn(_ours, 1, args=(str(tmp_path / "ck"),))[0]
    theirs = spawn(_theirs, 1, timeout=600.0)[0]
    assert ours == theirs
