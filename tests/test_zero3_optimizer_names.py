"""DeepSpeed's ZeRO-3 optimizer names under the runner (as_deepspeed/zero3_optimizer.py).

    python -m pytest -q tests/test_zero3_optimizer_names.py

On 2 ranks at stage 3: isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3) holds (and not
below stage 3); _get_norm_groups() equals the one-process reference's gradient norm (averaged over
the ranks' inputs), and after every gradient is halved through safe_set_local_grad it is half that
(read when called); _global_grad_norm after the step is engine.get_global_grad_norm().
"""
import copy

import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.as_deepspeed import quirks
from zero_from_scratch.as_deepspeed.zero3_optimizer import DeepSpeedZeroOptimizer_Stage3
from zero_from_scratch.engine.safe_api import safe_get_local_grad, safe_set_local_grad


def _cfg(stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}


def _run(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    xs = [torch.randn(2, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    engine, opt, *_ = zero_from_scratch.initialize(model=model, config=_cfg(3))
    quirks.expose_torch_optimizer(engine)
    engine.backward(engine(xs[rank]).pow(2).sum())
    before = float(opt._get_norm_groups()[0])
    for p in model.parameters():
        safe_set_local_grad(p, safe_get_local_grad(p) / 2)
    after = float(opt._get_norm_groups()[0])
    engine.step()
    (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
    want = float(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).norm())
    e1, opt1, *_ = zero_from_scratch.initialize(model=copy.deepcopy(ref), config=_cfg(1))
    quirks.expose_torch_optimizer(e1)
    return (isinstance(opt, DeepSpeedZeroOptimizer_Stage3), isinstance(opt1, DeepSpeedZeroOptimizer_Stage3),
            before, after, want, opt._global_grad_norm, engine.get_global_grad_norm())


def test_zero3_optimizer_names(spawn):
    for is3, is1, before, after, want, kept, norm in spawn(_run, 2):
        assert is3 and not is1
        assert abs(before - want) <= 1e-6 * want and abs(after - want / 2) <= 1e-6 * want   # fp32 rounding
        assert abs(kept - want / 2) <= 1e-6 * want and abs(norm - want / 2) <= 1e-6 * want


def _fp32_state_dict(rank, world):
    from parity.zero.ds_parity import make_config
    from parity.zero.sides import make_engine
    from parity.zero.universal_compare import GLOBAL_BATCH, _train
    from zero_from_scratch.engine.models import TinyMLP
    out = {}
    for side in ("deepspeed", "ours"):
        torch.manual_seed(0)
        model = TinyMLP()
        e = make_engine(side, model, [{"params": list(model.parameters())}],
                        make_config(3, micro_bs=GLOBAL_BATCH // world, gas=1), "primitives")
        if side == "ours":
            quirks.expose_torch_optimizer(e)
        _train(e, range(1, 3), rank, world)
        e.optimizer._set_fp32_optimizer_param_groups()
        sd = e.optimizer.optimizer.state_dict()
        e.optimizer._clear_fp32_optimizer_param_groups()
        out[side] = dict(state=sd["state"], params=[g["params"] for g in sd["param_groups"]],
                         shapes=[dict(s) for s in e._get_zero_param_shapes()])
    return out


def test_zero3_fp32_optimizer_state_dict_equals_deepspeeds(spawn):
    """Between _set_/_clear_fp32_optimizer_param_groups at stage 3 (DeepSpeed's unit/checkpoint tests read it
    so): this rank's flat partition per sub-group, each parameter's ceil(numel/N) piece, equal to DeepSpeed's
    after 2 AdamW steps of TinyMLP (13-37-3, a norm) on 2 ranks (1e-6 relative: fp32 reductions in another order)."""
    for res in spawn(_fp32_state_dict, 2):
        ds, rz = res["deepspeed"], res["ours"]
        assert rz["shapes"] == ds["shapes"] and rz["params"] == ds["params"] == [[0]]
        assert list(rz["state"]) == list(ds["state"])
        for g, st in ds["state"].items():
            assert float(rz["state"][g]["step"]) == float(st["step"]) == 2.0
            for k in ("exp_avg", "exp_avg_sq"):
                assert rz["state"][g][k].shape == st[k].shape == (356,), k    # 241 + 19 + 19 + 19 + 56 + 2 per rank
                torch.testing.assert_close(rz["state"][g][k], st[k], rtol=1e-6, atol=1e-9)
