"""The caller's own backward and boundary, as DeepSpeed 0.19.8 serves them (engine/z_ua_boundary.py).

    python -m pytest -q tests/test_user_backward.py

Two ranks, ZeRO stages 0-3 in one spawn each, fp32, against one-process torch (SGD, whose step is
linear in the gradient, so a wrong division shows, on the gradients a rank-average of the same
micro-batches gives):
- managed_gradient_accumulation=false: 2, 5, then 3 engine.backward calls before each step(); every
  step() updates (the reference: Σ of the micro-batch gradients ÷ gradient_accumulation_steps, as
  DeepSpeed divides by the configured count whatever the caller does), is_gradient_accumulation_boundary()
  is False between backwards, global_samples grows by micro-batch × ranks × backwards;
- engine.scale(loss).backward() (a plain autograd call) with gradient_accumulation_steps 2: the
  same weights as the reference after two optimizer steps; fp16's dynamic scaler refuses a plain
  backward without scale() with DeepSpeed's RuntimeError.
Tolerance 2e-6: fp32 sums over ranks and micro-batches in another order (the reference sums in one
process), through 2-3 SGD steps of lr 0.1.
"""
import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.z_ua_boundary import check_config

COUNTS, GAS, MICRO, LR, TOL = (2, 5, 3), 4, 2, 0.1, 2e-6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(rank, i):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(MICRO, 4, generator=g), torch.randn(MICRO, 1, generator=g)


def _cfg(stage, gas, managed, fp16=False):
    c = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
         "managed_gradient_accumulation": managed, "zero_optimization": {"stage": stage},
         "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True}
    if fp16:
        c["fp16"] = {"enabled": True}
    return c


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _reference(world, plan, gas):
    """plan: per step, the micro-batch indices each rank backs; torch SGD on Σ grads ÷ gas, averaged over ranks."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for idx in plan:
        opt.zero_grad()
        for r in range(world):
            for i in idx:
                (_loss(model, *_batch(r, i)) / gas / world).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _full(engine, model):
    with engine.gathered_parameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


def _unmanaged(rank, world, path):
    out = {}
    for stage in range(4):
        model = _model()
        engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(stage, GAS, False))
        i, seen = 0, []
        for n in COUNTS:
            for _ in range(n):
                x, y = _batch(rank, i)
                engine.backward(((engine(x) - y) ** 2).mean())
                seen.append(engine.is_gradient_accumulation_boundary())
                i += 1
            engine.step()
            seen.append(engine.was_step_applied())
        engine.save_checkpoint(path, tag=f"z{stage}")         # DeepSpeed's count survives a resume
        again, *_ = zero_from_scratch.initialize(model=_model(), config=_cfg(stage, GAS, False))
        again.load_checkpoint(path, tag=f"z{stage}")
        out[stage] = (seen, (engine.global_samples, again.global_samples), engine.global_steps, _full(engine, model))
        engine.destroy(), again.destroy()
    return out


def test_unmanaged_step_is_the_boundary(spawn, tmp_path):
    starts = [sum(COUNTS[:k]) for k in range(len(COUNTS))]
    want = _reference(2, [range(s, s + n) for s, n in zip(starts, COUNTS)], GAS)
    expect_seen = sum(([False] * n + [True] for n in COUNTS), [])
    for out in spawn(_unmanaged, 2, args=(str(tmp_path),)):
        for stage, (seen, samples, steps, params) in out.items():
            assert seen == expect_seen, stage
            assert (samples, steps) == ((MICRO * 2 * sum(COUNTS),) * 2, len(COUNTS)), stage
            for got, ref in zip(params, want):
                torch.testing.assert_close(got, ref, rtol=0, atol=TOL, msg=f"stage {stage}")


def _plain(rank, world):
    out = {}
    for stage in range(4):
        model = _model()
        engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(stage, 2, True))
        for i in range(4):
            x, y = _batch(rank, i)
            engine.scale(((engine(x) - y) ** 2).mean()).backward()   # not engine.backward: autograd's own
            engine.step()
        out[stage] = _full(engine, model)
        engine.destroy()
    model = _model()
    engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(1, 1, True, fp16=True))
    x, y = _batch(rank, 0)
    try:
        ((engine(x.half()) - y.half()) ** 2).mean().backward()
        out["fp16"] = None
    except RuntimeError as e:
        out["fp16"] = str(e)
    engine.destroy()
    return out


def test_scale_then_plain_backward(spawn):
    want = _reference(2, [range(0, 2), range(2, 4)], 2)
    for out in spawn(_plain, 2):
        assert "Loss scaling is required" in (out.pop("fp16") or "no error")
        for stage, params in out.items():
            for got, ref in zip(params, want):
                torch.testing.assert_close(got, ref, rtol=0, atol=TOL, msg=f"stage {stage}")


@pytest.mark.parametrize("stage,refused", [(0, True), (1, True), (2, False), (3, False)])
def test_unmanaged_overlap_comm_only_from_stage_2(stage, refused):
    cfg = _cfg(stage, 1, False)
    cfg["zero_optimization"]["overlap_comm"] = True
    if refused:
        with pytest.raises(AssertionError, match="overlap_comm only with ZeRO stage 2"):
            check_config(load_config(cfg, 1))
    else:
        check_config(load_config(cfg, 1))
