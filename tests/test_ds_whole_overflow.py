"""bf16.check_grad_overflow as DeepSpeed 0.19.8 (engine/step.py checks_overflow).

    python -m pytest -q tests/test_ds_whole_overflow.py

One rank, bf16, a NaN written into every gradient (safe_set_full_grad) before step(): at ZeRO stages
1-2 with check_grad_overflow false DeepSpeed's ZeRO optimizer steps anyway (the weights turn NaN, no
skipped step); by default, and at stage 3 whatever the key says, the step is skipped and the weights
stay finite.
"""
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.safe_api import safe_set_full_grad


def _one(stage, check):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    bf16 = {"enabled": True} if check is None else {"enabled": True, "check_grad_overflow": check}
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": bf16, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum())
    for p in model.parameters():
        safe_set_full_grad(p, torch.full_like(p, float("nan")))
    engine.step()
    with engine.gathered_parameters(list(model.parameters())):
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out = (engine.skipped_steps, finite)
    engine.destroy()
    return out


def _run(rank, world):
    return {(stage, check): _one(stage, check) for stage, check in
            ((1, False), (2, False), (3, False), (1, None), (2, True))}


def test_check_grad_overflow_false_steps_at_stages_1_2(spawn):
    (out,) = spawn(_run, 1)
    assert out == {(1, False): (0, False), (2, False): (0, False), (3, False): (1, True),
                   (1, None): (1, True), (2, True): (1, True)}


def _one_nan(rank, world):
    """Only the bias's gradient NaN, clipping on: DeepSpeed's invalid norm reads inf, so the clip zeroes the
    weight's finite gradient (Adam's first step from a zero gradient moves nothing) and the norm is inf."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "bf16": {"enabled": True, "check_grad_overflow": False}, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-1, "torch_adam": True}}}
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    before = model.weight.detach().clone()
    engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum())
    safe_set_full_grad(model.bias, torch.full_like(model.bias, float("nan")))
    engine.step()
    out = (engine.skipped_steps, torch.equal(model.weight.detach(), before), engine._global_grad_norm)
    engine.destroy()
    return out


def test_an_unchecked_nan_norm_clips_as_infinity(spawn):
    (out,) = spawn(_one_nan, 1)
    assert out == (0, True, float("inf"))
