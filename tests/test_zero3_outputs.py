"""ZeRO-3 module outputs as DeepSpeed gives them (engine/z3_outputs.py, engine/external.py).

    python -m pytest -q tests/test_zero3_outputs.py

A module that returns one of its Parameters (DeepSpeed's test_zero_context_return.py models):
the caller gets the parameter's `ds_param_alias`, AVAILABLE while the caller runs; under the
runner (DeepSpeed's dangling parameters) the parameter becomes an external parameter of the
outermost module still using it, and training equals one-process torch AdamW on the averaged
gradient (fp32: rounding only). 2 ranks.
"""
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.zero_init import ZeroParamStatus

CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
       "gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}


class Returns(nn.Linear):
    def forward(self, x):
        return super().forward(x), self.bias             # a dangling parameter


class Middle(nn.Linear):
    def __init__(self, d):
        super().__init__(d, d)
        self.inner = Returns(d, d)

    def forward(self, x):
        out, bias = self.inner(super().forward(x))
        if hasattr(getattr(bias, "ds_param_alias", bias), "ds_status"):       # the engine's model, not torch's
            seen.append((type(bias) is not nn.Parameter, getattr(bias, "ds_param_alias", bias).ds_status))
        return out, bias


class Outer(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.first, self.middle = nn.Linear(d, d), Middle(d)

    def forward(self, x):
        out, bias = self.middle(self.first(x))
        return (out + bias).pow(2).sum()


seen: list = []


def _xs(step, world):
    return [torch.randn(6, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]


def _train(rank, world):
    torch.manual_seed(0)
    model = Outer()
    engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    engine.external.auto_register = True                 # the runner's switch (as_deepspeed/quirks.py)
    for step in range(3):
        loss = engine(_xs(step, world)[rank])
        engine.backward(loss)
        engine.step()
        regs = (len(model._external_params), len(model.middle._external_params),
                len(model.middle.inner._external_params))
    with engine.gathered_parameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    return seen, regs, got


def test_returned_parameter_is_an_alias_registered_outermost_and_trains_like_torch(spawn):
    torch.manual_seed(0)
    ref = Outer()                                        # here, not in the ranks: AdamW's first use imports dynamo
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(3):
        opt.zero_grad()
        (sum(ref(x) for x in _xs(step, 2)) / 2).backward()   # the engine averages the ranks' gradients
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    for seen_, regs, got in spawn(_train, 2):
        assert seen_ == [(True, ZeroParamStatus.AVAILABLE)] * 3
        assert regs == (1, 0, 0)          # Outer adds it: registered there, left by Middle (as DeepSpeed)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6)   # fp32, different sum order


class Caller(nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.middle = middle

    def forward(self, x):
        return self.middle(x)


class Shared(nn.Module):
    """Middle called by two parents: the returned bias is registered to each in turn (DeepSpeed's rule)."""

    def __init__(self, d=6):
        super().__init__()
        middle = Middle(d)
        self.a, self.b = Caller(middle), Caller(middle)

    def forward(self, x):
        out, bias = self.a(x)
        out2, bias2 = self.b(out)
        return (out2 + bias + bias2).pow(2).sum()


def _shared(rank, world):
    torch.manual_seed(0)
    engine, *_ = zero_from_scratch.initialize(model=Shared(), config=CFG)
    engine.external.auto_register = True
    left = []
    for step in range(2):
        engine.backward(engine(_xs(step, world)[rank]))
        engine.step()
        left.append(sorted(len(c) for c in engine.external.calls.values()))
    return left, dict(engine.external.pins)


def test_every_call_releases_what_it_pinned_and_leaves_no_entry(spawn):
    for left, pins in spawn(_shared, 2):
        assert all(n == 0 for step in left for n in step) and all(v == 0 for v in pins.values())


class ReturnsDict(nn.Linear):
    def forward(self, x):
        return {"out": super().forward(x), "extra": [self.bias]}     # DeepSpeed walks dicts and lists too


class DictOuter(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.first, self.inner = nn.Linear(d, d), ReturnsDict(d, d)

    def forward(self, x):
        d = self.inner(self.first(x))
        bias = d["extra"][0]
        if hasattr(getattr(bias, "ds_param_alias", bias), "ds_status"):
            seen.append((type(bias) is not nn.Parameter, getattr(bias, "ds_param_alias", None) is self.inner.bias))
        return (d["out"] * bias).pow(2).sum()


def _dict_train(rank, world):
    seen.clear()
    torch.manual_seed(0)
    model = DictOuter()
    engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    engine.external.auto_register = True
    for step in range(2):
        engine.backward(engine(_xs(step, world)[rank]))
        engine.step()
    with engine.gathered_parameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    return list(seen), got


def test_dict_and_list_outputs_are_wrapped_as_deepspeed_wraps_them(spawn):
    torch.manual_seed(0)
    ref = DictOuter()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(2):
        opt.zero_grad()
        (sum(ref(x) for x in _xs(step, 2)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    for seen_, got in spawn(_dict_train, 2):
        assert seen_ == [(True, True)] * 2            # the alias, naming the parameter, inside a dict's list
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6)


class FrozenBiasReturns(nn.Linear):
    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias), self.bias


class CheckpointedFrozen(nn.Module):
    """A frozen bias returned inside a non-reentrant checkpoint (DeepSpeed's activation-checkpoint
    lifecycle test's model): the consumer sees the alias AVAILABLE, in forward and in the recompute."""

    def __init__(self, d=6):
        super().__init__()
        self.producer, self.head = FrozenBiasReturns(d, d), nn.Linear(d, 1)
        self.producer.bias.requires_grad_(False)
        self.statuses = []

    def _block(self, x):
        out, bias = self.producer(x)
        if hasattr(bias, "ds_param_alias"):
            self.statuses.append(bias.ds_param_alias.ds_status)
        return torch.tanh(out + bias)

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False)).sum()


def _frozen_returned(rank, world):
    torch.manual_seed(0)
    model = CheckpointedFrozen()
    cfg = {**CFG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True}
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg,
                                              model_parameters=[p for p in model.parameters() if p.requires_grad])
    engine.external.auto_register = True
    for step in range(2):
        engine.backward(engine(_xs(step, world)[rank].view(1, 6)))
        engine.step()
    with engine.gathered_parameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model.statuses, model.producer.bias.is_external_param, got


def test_frozen_parameter_returned_in_a_checkpoint_keeps_its_alias_and_trains_like_torch(spawn):
    torch.manual_seed(0)
    ref = CheckpointedFrozen()
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        opt.zero_grad()
        (sum(ref(x.view(1, 6)) for x in _xs(step, 2)) / 2).backward()
        opt.step()
    for statuses, external, got in spawn(_frozen_returned, 2):
        assert statuses == [ZeroParamStatus.AVAILABLE] * 4 and external      # 2 forwards, 2 recomputes
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6)   # fp32, different sum order
