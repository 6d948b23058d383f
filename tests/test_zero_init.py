"""zero.Init and GatheredParameters (zero_from_scratch/engine/zero_init.py, zero_partition.py).

    python -m pytest -x -q tests/test_zero_init.py            (+ -m slow: T5 and DistilBERT too)

Every test runs 2 ranks and compares against the same constructor run without Init under the same
seed, in the same process: values must be bit-equal (Init changes where tensors live, not a single
RNG draw), and training losses through initialize() equal the plain model's exactly (the engine's
shards hold the same bits either way, so every collective and every step is the same).
"""
import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.zero_init import GatheredParameters, Init, ZeroParamStatus

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Net(nn.Module):
    """Children initialise themselves; the parent then edits their (already partitioned) weights."""

    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(10, d, padding_idx=0)
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, 3)
        nn.init.normal_(self.a.weight, std=0.02)
        self.b.bias.data.zero_()
        self.emb.weight.data[self.emb.padding_idx].fill_(3.0)

    def forward(self, ids):
        return self.b(torch.relu(self.a(self.emb(ids)))).mean(1)


def build(init: bool, ctor=Net, **kw):
    torch.manual_seed(0)
    if not init:
        return ctor()
    with Init(dtype=torch.float32, **kw):
        return ctor()


def _full(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        with GatheredParameters(p):
            out[n] = p.detach().clone()
    return out


def _construct(rank, world):
    ref, m = build(False), build(True)
    shapes = {n: (tuple(p.shape), tuple(p.ds_shape), p.ds_tensor.numel(), p.ds_status) for n, p in m.named_parameters()}
    full = _full(m)
    same = {n: torch.equal(full[n], p) for n, p in ref.named_parameters()}
    ids = [p.ds_id for p in m.parameters()]
    return shapes, same, ids, all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in m.parameters())


def test_init_partitions_as_built_and_equals_plain_constructor(spawn):
    res = spawn(_construct, 2)
    for shapes, same, ids, released in res:
        assert all(same.values()), same
        for n, (shape, ds_shape, shard, status) in shapes.items():
            numel = torch.Size(ds_shape).numel()
            assert shape == (0,) and shard == -(-numel // 2), (n, shape, shard)
            assert status is ZeroParamStatus.NOT_AVAILABLE
        assert released
    assert res[0][2] == res[1][2] == sorted(res[0][2])     # ds_id: creation order, same on every rank


def _modify(rank, world):
    m = build(True)
    with GatheredParameters([m.a.weight, m.b.bias], modifier_rank=1):
        assert m.a.weight.shape == (16, 8)
        m.a.weight.data.fill_(0.5 if rank == 1 else -9.0)     # only rank 1's edit may survive
        m.b.bias.data.fill_(rank + 1.0)
    shard = m.a.weight.ds_tensor.clone()
    with GatheredParameters(m.a.weight):                       # read only: nothing written back
        m.a.weight.data.fill_(7.0)
    full = _full(m)
    return shard, full["a.weight"], full["b.bias"]


def test_gathered_parameters_modifier_rank_on_init_params(spawn):
    for shard, w, b in spawn(_modify, 2):
        assert torch.equal(shard, torch.full((64,), 0.5))
        assert torch.equal(w, torch.full((16, 8), 0.5)) and torch.equal(b, torch.full((3,), 2.0))


def _train(rank, world, init: bool, edit: bool):
    model = build(init)
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    losses = []
    for step in range(4):
        if edit and step == 2:                                 # rank 0 writes, every shard follows
            with GatheredParameters(model.a.weight, modifier_rank=0):
                if rank == 0:
                    model.a.weight.data.mul_(0.5)
        g = torch.Generator().manual_seed(10 * step + rank)
        loss = engine(torch.randint(0, 10, (2, 5), generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, {n: v.tolist() for n, v in _full(model).items()}


def test_initialize_adopts_init_model_and_trains_like_plain(spawn):
    runs = {(init, edit): spawn(_train, 2, args=(init, edit)) for init in (False, True) for edit in (False, True)}
    for edit in (False, True):
        for (lp, fp), (li, fi) in zip(runs[False, edit], runs[True, edit]):
            assert lp == li                                    # exact: same shards, same collectives
            assert fp == fi
    for r in range(2):                                         # the edit was seen by rank 1 too
        assert runs[True, True][r][0][:2] == runs[True, False][r][0][:2]
        assert runs[True, True][r][0][2] != runs[True, False][r][0][2]
