"""ZeRO-3 leaf modules (engine/leaf.py): a mixture-of-experts block whose routing differs by rank,
flagged with DeepSpeed's set_z3_leaf_modules, trains at ZeRO-3; DeepSpeed's flag functions.

    python -m pytest -q tests/test_zero_leaf.py            (-m slow: against real DeepSpeed 0.19.8)

Reference: one process on both ranks' batches (the mean of the ranks' losses): per-step losses and
the weights after 3 AdamW steps within 1e-6 (a different summation order); a frozen expert stays as
it was. Slow: real DeepSpeed's engine in the same processes, same weights and batches: losses within
1e-6 relative, weights within 1e-6.
"""
import pytest
import torch
import torch.nn as nn

from zero_from_scratch.engine import leaf

STEPS, D = 3, 8


class MoE(nn.Module):
    """Top-1 of 4 experts for the whole batch, chosen by the batch: each rank runs a different one."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.chosen = []

    def forward(self, x):
        w = self.gate(x).softmax(-1)
        i = int(w.mean(0).argmax())
        self.chosen.append(i)
        return self.experts[i](x) * w[:, i:i + 1]


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, D), MoE(), nn.Linear(D, 4))
    m[1].experts[3].bias.requires_grad_(False)        # a frozen parameter inside the leaf
    return m


def _batch(t, rank):
    g = torch.Generator().manual_seed(100 * t + 7 * rank)
    return torch.randn(4, D, generator=g) * (1 + 2 * rank), torch.randn(4, 4, generator=g)


CFG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _train(side, init, set_leaf, rank):
    from parity.zero.sides import full_params
    m = _model()
    set_leaf(m, [MoE])
    engine, *_ = init(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad], config=CFG)
    losses = []
    for t in range(STEPS):
        x, y = _batch(t, rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, full_params(side, engine, 3), m[1].chosen


def _ours(rank, world):
    import zero_from_scratch
    return _train("ours", zero_from_scratch.initialize, leaf.set_z3_leaf_modules, rank)


def _reference(world):
    m = _model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = []
    for t in range(STEPS):
        per_rank = [nn.functional.mse_loss(m(x), y) for x, y in (_batch(t, r) for r in range(world))]
        (sum(per_rank) / world).backward()
        for p in m.parameters():                  # an expert nobody ran: a zero gradient, still stepped (momentum,
            if p.requires_grad and p.grad is None:  # decay), as ZeRO's flat partitions and DeepSpeed's leaf hook do
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        losses.append([v.item() for v in per_rank])
    return losses, {n: p.detach() for n, p in m.named_parameters()}


def _check(res, world, tol=1e-6):
    ref_l, ref_w = _reference(world)
    assert res[0][2] != res[1][2]                     # the ranks ran different experts
    for rank, (losses, weights, _) in enumerate(res):
        assert losses == pytest.approx([l[rank] for l in ref_l], rel=tol)
        for n, w in ref_w.items():
            assert torch.allclose(weights[n], w, atol=tol), n
        assert torch.equal(weights["1.experts.3.bias"], _model()[1].experts[3].bias)


def test_leaf_moe_at_zero3_equals_one_process(spawn):
    _check(spawn(_ours, 2), 2)


def test_flag_functions_as_deepspeeds():
    m = _model()
    assert leaf.set_z3_leaf_modules(m, ["MoE"]) == [m[1]] and leaf.z3_leaf_module(m[1])
    assert leaf.get_z3_leaf_modules(m) == [m[1]]
    assert leaf.unset_z3_leaf_modules(m, [MoE]) == [m[1]] and leaf.get_z3_leaf_modules(m) == []
    with pytest.raises(ValueError, match="No modules of type"):
        leaf.set_z3_leaf_modules(m, [nn.Conv2d])
    assert leaf.set_z3_leaf_modules_by_name(m, ["1.gate", "nope"], raise_if_not_found=False) == ([m[1].gate], ["nope"])
    assert leaf.set_z3_leaf_modules_by_suffix(m, ["experts"]) == ([m[1].experts], [])
    assert [n for n, _ in leaf.outermost_leaves(m)] == ["1.gate", "1.experts"]
    assert leaf.apply_config(_model(), {"name_suffixes": "1"}, 0)[0].__class__ is MoE   # a string coerced


def _both(rank, world):
    from parity.zero.sides import prepare_deepspeed
    ds = prepare_deepspeed()
    from deepspeed.utils import set_z3_leaf_modules
    return _train("deepspeed", ds.initialize, set_z3_leaf_modules, rank), _ours(rank, world)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_leaf_moe_at_zero3_equals_deepspeed(spawn):
    pytest.importorskip("deepspeed")
    res = spawn(_both, 2, timeout=600.0)
    for rank, ((ds_l, ds_w, ds_c), (l, w, c)) in enumerate(res):
        assert c == ds_c and l == pytest.approx(ds_l, rel=1e-6)
        for n in ds_w:
            assert torch.allclose(w[n], ds_w[n], atol=1e-6), n
