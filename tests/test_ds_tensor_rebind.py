"""ZeRO-3 `ds_tensor` under the runner: a rebinding refused, views held past a step kept out of the master.

    python -m pytest -q tests/test_ds_tensor_rebind.py     (2 ranks, ringzero only: a few seconds)

`p.ds_tensor = t` rebinds the attribute: DeepSpeed's gathers would read t from then on, ringzero's
read the engine's shard, so the next forward refuses it, naming the parameter (engine/z3_ds_tensor.py
check_bound). A view, slice or reshape of ds_tensor taken before a step and written after it (fp32)
changes the partition the gathers read, not the fp32 master, as in DeepSpeed, where ds_tensor is the
16-bit copy and the master is apart: checked against safe_get_local_fp32_param (the master) before
and after the write, and against the next forward, which must see the written values.
"""
import importlib.util

import pytest
import torch

from primitives.launch import spawn
from tests.test_ds_tensor import CFG, Net, X

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")


def _run(rank, world):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    model = Net()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    a, c = model.a.weight, model.c.weight
    sparse = a.ds_tensor.to_sparse().to_dense(), a.ds_tensor.clone()   # an output without storage: not a view
    va, vc = a.ds_tensor[2:], c.ds_tensor.reshape(2, -1)     # a slice and a reshape, both views of the shard
    engine.backward(engine(X).sum())
    engine.step()                                  # drops every kept master copy
    hp = [ds.utils.safe_get_local_fp32_param(w).clone() for w in (a, c)]
    va.fill_(4.0)
    vc.mul_(-3.0)
    after = [ds.utils.safe_get_local_fp32_param(w).clone() for w in (a, c)]
    parts = [a.ds_tensor.clone(), c.ds_tensor.clone()]
    with ds.zero.GatheredParameters([a, c]):
        full = [a.detach().clone(), c.detach().clone()]
    model.b.weight.ds_tensor = torch.zeros_like(model.b.weight.ds_tensor)    # every rank: no one waits in a gather
    with pytest.raises(NotImplementedError) as e:
        engine(X)
    return (hp, after, parts, full), str(e.value), sparse


@pytest.fixture(scope="module")
def runs():
    return spawn(_run, 2, timeout=180.0)      # both checks on one engine per rank


def test_rebinding_ds_tensor_is_refused_at_the_next_gather(runs):
    for _, msg, _ in runs:
        assert msg.startswith("b.weight.ds_tensor was rebound (p.ds_tensor = t): DeepSpeed's all-gathers would read t")
        assert "p.ds_tensor.copy_(t)" in msg


def test_views_written_after_a_step_reach_the_partition_not_the_fp32_master(runs):
    for r, ((hp, after, parts, full), _, _) in enumerate(runs):
        assert torch.equal(after[0], hp[0]) and torch.equal(after[1], hp[1])     # the masters: unwritten
        assert torch.equal(parts[0], torch.cat([hp[0][:2], torch.full((6,), 4.0)]))
        assert torch.equal(parts[1], -3 * hp[1])
        s = parts[0].numel()                       # the gathers read the written partitions
        assert torch.equal(full[0].reshape(-1)[r * s:(r + 1) * s][2:], torch.full((min(s, 15 - r * s) - 2,), 4.0))


def test_a_sparse_copy_of_ds_tensor_is_its_values(runs):
    for _, _, (dense, part) in runs:
        assert torch.equal(dense, part)
