"""engine.coalesce_grad_reduction() as DeepSpeed 0.19.8 serves it (engine/coalesce.py).

    python -m pytest -q tests/test_coalesce.py

Two ranks, ZeRO stages 1-3 (and 3 with every Linear a leaf module) in one spawn, fp32, against one-process torch (SGD, whose step is linear
in the gradient, so a lost, doubled or undivided micro-batch shows): two optimizer steps, each a block
of 3 engine.backward calls (gradient_accumulation_steps 3, DeepSpeed's pattern: the boundary set on
the last backward), then step(). Inside the block no gradient collective runs (the ledger's count is
0), on exit one per unit; safe_get_full_grad inside reads the rank's own sum (DeepSpeed: its local
param.grad), checked against torch on that rank's micro-batches; the boundary flag found is restored. Tolerance 2e-6: fp32 sums over
ranks and micro-batches in another order than the one-process reference, through 2 SGD steps of lr 0.1.
DeepSpeed's refusals, with its words: stage 0, nesting in no_sync, step() inside the block.
"""
import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.leaf import set_z3_leaf_modules
from zero_from_scratch.engine.safe_api import safe_get_full_grad
from tests.test_user_backward import _batch, _model   # the same model and micro-batches (MICRO = 2 there too)

N, GAS, MICRO, LR, TOL = 3, 3, 2, 0.1, 2e-6


def _cfg(stage):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},     # stage 2: more than one unit
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True}


def _reference(world):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        opt.zero_grad()
        for r in range(world):
            for i in range(step * N, step * N + N):
                x, y = _batch(r, i)
                (((model(x) - y) ** 2).mean() / GAS / world).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _local_grad(rank):
    """The first layer's weight gradient of this rank's first block, one-process torch."""
    model = _model()
    for i in range(N):
        x, y = _batch(rank, i)
        (((model(x) - y) ** 2).mean() / GAS).backward()
    return model[0].weight.grad


def _grad_calls(engine) -> int:
    return sum(u.calls for k, u in engine.comm.usage.items() if k.startswith("grad "))


def _run(rank, world):
    out = {}
    for stage in (1, 2, 3, "3 leaf"):
        model = _model()
        if stage == "3 leaf":            # ZeRO-3 leaf modules whose input needs no grad: their hook waits too
            set_z3_leaf_modules(model, [nn.Linear])
        engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(3 if stage == "3 leaf" else stage))
        calls = []
        for step in range(2):
            engine.set_gradient_accumulation_boundary(False)
            with engine.coalesce_grad_reduction():
                for i in range(step * N, step * N + N):
                    x, y = _batch(rank, i)
                    engine.set_gradient_accumulation_boundary(i % N == N - 1)
                    engine.backward(((engine(x) - y) ** 2).mean())
                calls.append(_grad_calls(engine))
                local = safe_get_full_grad(model[0].weight) if step == 0 else local
            calls.append(_grad_calls(engine))
            restored = engine._is_gradient_accumulation_boundary
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        with engine.gathered_parameters(list(model.parameters())):
            params = [p.detach().clone() for p in model.parameters()]
        torch.testing.assert_close(local, _local_grad(rank), rtol=0, atol=TOL, msg=f"stage {stage}")
        out[stage] = (calls, restored, len(engine.layout.units), params)
        engine.destroy()
    errors = []
    for stage, attempt in ((0, "block"), (2, "no_sync"), (1, "step")):
        engine, *_ = zero_from_scratch.initialize(model=_model(), config=_cfg(stage))
        try:
            if attempt == "no_sync":
                with engine.no_sync() if stage < 2 else engine.coalesce_grad_reduction():
                    with engine.coalesce_grad_reduction():
                        pass
            with engine.coalesce_grad_reduction():
                engine.step()
        except (AssertionError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {e}")
        engine.destroy()
    out["errors"] = errors
    return out


def test_coalesced_block_equals_torch(spawn):
    want = _reference(2)
    for out in spawn(_run, 2):
        assert out.pop("errors") == [
            "NotImplementedError: coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage 0",
            "AssertionError: coalesce_grad_reduction cannot be nested inside another no_sync context",
            "AssertionError: It is illegal to call Engine.step() inside no_sync context manager"]
        for stage, (calls, restored, units, params) in out.items():
            assert calls == [0, units, 0, units], (stage, calls)      # none inside, one per unit on exit
            assert restored is False, stage
            for got, ref in zip(params, want):
                torch.testing.assert_close(got, ref, rtol=0, atol=TOL, msg=f"stage {stage}")
