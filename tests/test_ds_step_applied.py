"""engine.was_step_applied() across load_checkpoint, as DeepSpeed: a load leaves it as it was.

    python -m pytest -q tests/test_ds_step_applied.py

DeepSpeed's `_step_applied` is set by each step() and nothing else (runtime/engine.py), so after a
load it still says whether this engine's latest step() updated the weights, whatever step counter the
checkpoint restores. On 2 ranks: stepped engine loads an older checkpoint → still True; a fresh engine
loads it → still False.
"""
import torch
import torch.nn as nn

import zero_from_scratch

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 2}}


def _run(rank, world, path):
    torch.manual_seed(0)
    engine, *_ = zero_from_scratch.initialize(model=nn.Linear(3, 2), config=CFG)
    x = torch.randn(2, 3)
    for i in range(2):
        engine.backward(engine(x).sum())
        engine.step()
        if i == 0:
            engine.save_checkpoint(path, tag="one")
    out = [engine.was_step_applied()]
    engine.load_checkpoint(path, tag="one")
    out.append(engine.was_step_applied())
    fresh, *_ = zero_from_scratch.initialize(model=nn.Linear(3, 2), config=CFG)
    fresh.load_checkpoint(path, tag="one")
    return out + [fresh.was_step_applied()]


def test_a_load_leaves_was_step_applied_as_it_was(spawn, tmp_path):
    for got in spawn(_run, 2, args=(str(tmp_path),)):
        assert got == [True, True, False]
