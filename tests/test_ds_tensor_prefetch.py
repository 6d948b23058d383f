"""ZeRO-3 prefetch under the runner as DeepSpeed 0.19.8's coordinator orders it (prefetch.py ds_order).

    python -m pytest -q tests/test_ds_tensor_prefetch.py      (2 ranks, ~5 s)

Three modules of one 3×5 weight each, stage3_prefetch_bucket_size = every element, max_reuse_distance 0
(DeepSpeed's tests/unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_prefetching): from the
second micro-batch on, before each module's forward its weight is gathered or in flight, and after it
the weight stays gathered (a prefetch scan passed its backward), as DeepSpeed's ds_status shows; the
first micro-batch (recording the trace) releases each after its forward. The outputs are the same
with and without prefetch. ringzero's own engine keeps its release after forward (checked too).
"""
import importlib.util

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")


class Mul(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3, 5), v))

    def forward(self, x):
        return self.weight * x


class Net(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.layers, self.seen = nn.ModuleList(Mul(v) for v in (1.0, 2.0, 3.0)), seen

    def forward(self, x):
        for m in self.layers:
            before = m.weight.ds_status.name
            x = m(x)
            self.seen.append((before, m.weight.ds_status.name))
        return x


def _run(rank, world, runner, prefetch):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero") if runner else None
    import zero_from_scratch
    seen = []
    model = Net(seen)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 45 if prefetch else 0}}
    if not runner:
        cfg["zero_optimization"]["overlap_comm"] = True      # ringzero's own prefetches only with it
    engine, *_ = (ds.initialize if runner else zero_from_scratch.initialize)(
        model=model, model_parameters=model.parameters(), config=cfg)
    outs, per_iter = [], []
    for _ in range(3):
        seen.clear()
        y = engine(torch.ones(3, 5))
        per_iter.append(list(seen))
        engine.backward(y.sum())
        engine.step()
        outs.append(y.detach().clone())
    return outs, per_iter


@pytest.mark.parametrize("prefetch", [True, False])
def test_runner_keeps_prefetched_weights_gathered_as_deepspeed(spawn, prefetch):
    for outs, per_iter in spawn(_run, 2, args=(True, prefetch)):
        assert all(torch.equal(o, torch.full((3, 5), 6.0)) for o in outs)    # lr 0: the weights stay
        assert per_iter[0] == [("NOT_AVAILABLE", "NOT_AVAILABLE")] * 3         # recording the trace
        for it in per_iter[1:]:
            if prefetch:      # gathered or in flight before, still gathered after (DeepSpeed's test's states)
                assert all(b in ("INFLIGHT", "AVAILABLE") and a == "AVAILABLE" for b, a in it), it
            else:
                assert it == [("NOT_AVAILABLE", "NOT_AVAILABLE")] * 3, it


def test_own_engine_releases_after_forward(spawn):
    for outs, per_iter in spawn(_run, 2, args=(False, True)):
        assert all(torch.equal(o, torch.full((3, 5), 6.0)) for o in outs)
        assert all(a == "NOT_AVAILABLE" for it in per_iter for _, a in it), per_iter
