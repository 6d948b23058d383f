"""A second ZeRO-3 engine on the same model (zero_partition.release_from_other_engines + destroy).

    python -m pytest -q tests/test_zero3_engines.py

DeepSpeed scripts call `deepspeed.initialize` twice on one model (a frozen reference copy, a
re-initialize after editing the config). The first engine is destroyed: none of its hooks may
stay on the model, frozen-parameter and external-parameter hooks included, or its forward
gathers keep installing its own (stale) copy of the weights. Checked on 2 ranks against a
one-process torch reference and against the hooks of one fresh engine.
"""
import copy

import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.external import register_external_parameter
from zero_from_scratch.engine.zero_init import GatheredParameters

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
       "zero_optimization": {"stage": 3}}     # DeepSpeed's persistence threshold: small units stay gathered


class Net(nn.Module):
    """A frozen first layer, and a head that also reads the frozen bias (an external parameter)."""

    def __init__(self):
        super().__init__()
        self.frozen, self.head = nn.Linear(5, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        register_external_parameter(self.head, self.frozen.bias)

    def forward(self, x):
        return self.head(torch.relu(self.frozen(x))) + self.frozen.bias


def _hooks(model) -> list:
    return [(n, len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_pre_hooks),
             len(m._backward_hooks)) for n, m in model.named_modules()]


def _two_engines(rank, world):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    fresh = copy.deepcopy(model)
    zero_from_scratch.initialize(model=fresh, config=CFG)
    first, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(rank))
    first(x).sum()                                    # the first engine gathers (and keeps) its units
    second, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    with GatheredParameters([model.frozen.weight, model.frozen.bias], modifier_rank=0):
        if rank == 0:                                 # an edit through the second engine only
            model.frozen.weight.data.mul_(0.5)
            model.frozen.bias.data.add_(1.0)
    with torch.no_grad():
        ref.frozen.weight.mul_(0.5)
        ref.frozen.bias.add_(1.0)
    outs = [second(x).detach() for _ in range(2)]
    return _hooks(model), _hooks(fresh), outs, ref(x).detach()


def test_second_engine_leaves_none_of_the_first_engines_hooks(spawn):
    for hooks, fresh_hooks, outs, want in spawn(_two_engines, 2):
        assert hooks == fresh_hooks
        for out in outs:
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)   # fp32, same ops: rounding only


def _twice_threshold_0(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    cfg = {**CFG, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    zero_from_scratch.initialize(model=model, config=cfg)     # every unit partitioned, none kept gathered
    second, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    return second(x).detach(), ref(x).detach()


def test_second_initialize_re_partitions_units_of_two_parameters(spawn):
    """The first engine gathers 0.weight's unit after re-partitioning 0.bias (or the other way round):
    its own re-partition must not read as a user's `p.ds_tensor = t` (z3_ds_tensor.check_bound)."""
    for out, want in spawn(_twice_threshold_0, 2):
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)   # fp32, same ops: rounding only
