"""DeepSpeed's per-module ZeRO-3 hook state and its granularity leaves, under the runner.

    python -m pytest -q tests/test_zero3_hooks.py          (~3 s)

- every module its own `pre_bwd_fn` / `post_bwd_fn` (a wrapper that forwards attribute reads to the
  module it wraps too) and `applied_pre_backward_ref_cnt`: one per forward call of a module whose
  outputs need a gradient, back to 0 once its backward gather ran (engine/z3_outputs.py);
- stage3_module_granularity_threshold: DeepSpeed's granularity (elements ÷ non-container layers of
  the subtree), flagged top-down (engine/leaf.py set_by_granularity), checked by hand on a small tree.
"""
import pytest
import torch
import torch.nn as nn

from primitives.launch import spawn
from zero_from_scratch.engine import leaf


class Delegating(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, x):
        return self.inner(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.wrap = nn.Linear(4, 4), Delegating(nn.Linear(4, 4))

    def forward(self, x):
        return self.wrap(self.first(x)).sum()


def _rank(rank, world):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    ds.init_distributed(dist_backend="gloo")
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    own = all(k in m.__dict__ for m in model.modules() for k in ("pre_bwd_fn", "post_bwd_fn"))
    distinct = model.wrap.__dict__["pre_bwd_fn"] is not model.wrap.inner.__dict__["pre_bwd_fn"]
    loss = engine(torch.randn(2, 4))
    after_forward = model.first.__dict__["applied_pre_backward_ref_cnt"]
    engine.backward(loss)
    after_backward = [m.__dict__["applied_pre_backward_ref_cnt"] for m in model.modules()]
    return own, distinct, after_forward, after_backward


def test_each_module_has_its_own_backward_functions_and_count():
    (own, distinct, after_forward, after_backward), = spawn(_rank, 1, timeout=60)
    assert own and distinct
    assert after_forward == 1 and after_backward == [0, 0, 0, 0]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)           # 40 elements, 2 layers + itself: 13


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.own = nn.Parameter(torch.zeros(100))
        self.block, self.head = Block(), nn.Linear(4, 2)
        self.stack = nn.ModuleList([Block()])      # a container: never a leaf itself, counted in its parent
        # the root: 100 + 40 + 10 + 40 = 190 elements, 3 + 1 + 3 layers + itself = 8: 190 // 8 = 23


def test_granularity_threshold_flags_leaves_top_down():
    m = Root()
    assert leaf.set_by_granularity(m, 23) == [m]                    # the root itself at 23
    m = Root()
    assert leaf.set_by_granularity(m, 20) == [m.block, m.stack[0]]  # under it, the blocks (13); no Linear
    assert not leaf.z3_leaf_module(m) and not leaf.z3_leaf_module(m.head)
    with pytest.warns(UserWarning, match=r"smallest module granularity is \[Block:13\].*>= 13"):
        assert leaf.set_by_granularity(Root(), 12) == []            # below every granularity: none, warned
