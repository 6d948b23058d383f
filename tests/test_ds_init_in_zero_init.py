"""Under the runner, deepspeed.initialize at ZeRO stage 0 inside an open zero.Init (as_deepspeed/quirks.py).

    python -m pytest -q tests/test_ds_init_in_zero_init.py

DeepSpeed 0.19.8 builds the engine there (runtime/engine.py keeps the partitioned parameters; its
stages 0-2 cannot train them, DeepSpeed's own test only calls a method of the model through the
engine). The runner gathers them whole, and the open context leaves that model whole when it closes
(zero_partition.make_whole); a module built later in the same context is still partitioned.
Two ranks against the same script without zero.Init under the same seed (the reference): the
weights after the block and the losses of three steps are equal, exactly (same values, same
collectives, same order). -m slow: the bulk run's
test_zero_context.py::TestSerialContext::test_throughput_calculation builds this case too.
"""
import pytest
import torch
import torch.nn as nn

from zero_from_scratch.as_deepspeed.top import initialize
from zero_from_scratch.as_deepspeed.zero_init import Init

CFG = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

    def magic(self):
        return 42


def _run(rank, world, under_init: bool):
    torch.manual_seed(0)
    later = None
    with Init(dtype=torch.float32, enabled=under_init):
        model = Model()
        engine, *_ = initialize(model=model, config=CFG, model_parameters=model.parameters())
        if under_init:
            later = nn.Linear(3, 3)                           # built after initialize: partitioned as usual
    assert engine.magic() == 42                               # the engine forwards to the model, as DeepSpeed's
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(3):
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kept = [hasattr(p, "ds_id") for p in model.parameters()]
    return start, losses, kept, later is not None and later.weight.ds_tensor.numel() == 5


def _both(rank, world):
    return _run(rank, world, False), _run(rank, world, True)


@pytest.mark.slow
def test_initialize_at_stage0_inside_init_trains_like_without_init(spawn):
    for (ref_start, ref_losses, _, _), (start, losses, kept, later_partitioned) in spawn(_both, 2):
        assert start.keys() == ref_start.keys()
        assert all(torch.equal(start[n], ref_start[n]) for n in start)
        assert losses == ref_losses
        assert not any(kept) and later_partitioned
