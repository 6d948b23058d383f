"""DeepSpeed's ZeRO-3 `averaged_gradients` and `allreduce_gradients` (engine/z3_grads.py).

    python -m pytest -q tests/test_zero3_grads.py

On 2 ranks, two backwards without a step (DeepSpeed's test_zero.py does the same): for every
one-parameter module, rank r's entry equals the one-process reference's gradient averaged over
the ranks' inputs and summed over the two backwards, sliced at [r·⌈n/2⌉, (r+1)·⌈n/2⌉) and
zero-padded (fp32: rounding only); allreduce_gradients changes nothing after backward; a
parameter sharing its module with others is refused with the reason.
"""
import copy
import math

import pytest
import torch
import torch.nn as nn

import zero_from_scratch

CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.w


def _xs(step, world):
    return [torch.randn(7, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]


def _grads(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(Scale(7), Scale(7))          # 7 elements: rank 1's partition is zero-padded
    ref = copy.deepcopy(model)
    engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    for step in range(2):
        engine.backward(engine(_xs(step, world)[rank]).pow(2).sum())
        before = [g.clone() for g in engine.optimizer.averaged_gradients[0]]
        engine.allreduce_gradients()
        after = list(engine.optimizer.averaged_gradients[0])
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    for step in range(2):
        (sum(ref(x).pow(2).sum() for x in _xs(step, world)) / world).backward()
    want = []
    for p in ref.parameters():
        ps = math.ceil(p.numel() / world)
        want.append(torch.cat([p.grad.reshape(-1), torch.zeros(ps * world - p.numel())])[rank * ps:(rank + 1) * ps])
    shared = nn.Sequential(nn.Linear(3, 2))
    e2, *_ = zero_from_scratch.initialize(model=shared, config=CFG)
    e2.backward(e2(torch.ones(3)).sum())
    with pytest.raises(NotImplementedError, match="shares its ZeRO-3 unit"):
        e2.optimizer.averaged_gradients[0]
    return list(engine.optimizer.averaged_gradients.keys()), after, want


def test_averaged_gradients_are_each_parameters_partition_of_the_mean_gradient(spawn):
    for keys, got, want in spawn(_grads, 2):
        assert keys == [0]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
