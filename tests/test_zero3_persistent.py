"""ZeRO-3's small parameters stay gathered after the optimizer step, as DeepSpeed keeps them.

    python -m pytest -q tests/test_zero3_persistent.py

DeepSpeed gathers its persistent parameters (at most stage3_param_persistence_threshold elements)
again at the end of every step (runtime/zero/stage3.py::_post_step), so a script reads a small
parameter's trained value between steps without a GatheredParameters block. Checked on 2 ranks:
the value read after each step equals the one gathered from the stepped shards (GatheredParameters,
after the read); with the threshold 0 the same parameter is partitioned after the step.
"""
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.engine.zero_init import GatheredParameters


def _cfg(threshold):
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}


class Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor([0.5])), nn.Parameter(torch.tensor([0.1]))

    def forward(self, x, y):
        return ((self.a * x + self.b - y) ** 2).mean()


def _train(rank, world, threshold):
    torch.manual_seed(0)
    model = Affine()
    engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(threshold))
    x = torch.randn(4, generator=torch.Generator().manual_seed(1))
    seen = []
    for _ in range(3):
        engine.backward(engine(x, 2 * x + 1))
        engine.step()
        held = (model.a.numel(), model.a.detach().clone())
        with GatheredParameters([model.a]):
            seen.append((*held, model.a.detach().clone()))
    return seen


def test_persistent_parameters_are_gathered_after_every_step(spawn):
    for seen in spawn(_train, 2, args=(100_000,)):
        assert len({float(want) for _, _, want in seen}) == 3      # the parameter moved every step
        for n, got, want in seen:
            assert n == 1 and torch.equal(got, want)             # the copy kept is the stepped value


def test_below_the_threshold_they_are_partitioned_after_the_step(spawn):
    for seen in spawn(_train, 2, args=(0,)):
        assert [n for n, _, _ in seen] == [0, 0, 0]


def _save(rank, world, path):
    torch.manual_seed(0)
    model = Affine()
    model.b.requires_grad_(False)          # a frozen one is persistent too (DeepSpeed's mark_persistent_parameters)
    engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(100_000))
    x = torch.randn(4, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x, 2 * x + 1))
    engine.step()
    engine.empty_partition_cache()
    released = (model.a.numel(), model.b.numel())
    engine.save_checkpoint(path, tag="t")
    held = [p.detach().clone() for p in (model.a, model.b)]
    with GatheredParameters([model.a, model.b]):
        want = [p.detach().clone() for p in (model.a, model.b)]
    return released, held, want


def test_a_save_gathers_persistent_parameters_again(spawn, tmp_path):
    """DeepSpeed's checkpoint_event_epilogue: after a save the persistent parameters are gathered,
    even where empty_partition_cache released them before it."""
    for released, held, want in spawn(_save, 2, args=(str(tmp_path),)):
        assert released == (0, 0)
        assert all(torch.equal(h, w) and h.numel() == 1 for h, w in zip(held, want))


def _destroy(rank, world, threshold):
    torch.manual_seed(0)
    model = Affine()
    engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(threshold))
    x = torch.randn(4, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x, 2 * x + 1))
    engine.step()
    with GatheredParameters([model.a]):
        want = model.a.detach().clone()
    engine.destroy()
    return model.a.numel(), model.a.detach().clone(), want


def test_destroy_leaves_persistent_parameters_gathered_as_deepspeed(spawn):
    for n, got, want in spawn(_destroy, 2, args=(100_000,)):
        assert n == 1 and torch.equal(got, want)
    for n, _, _ in spawn(_destroy, 2, args=(0,)):
        assert n == 0                                # the others stay partitioned
