"""Bad input to the pipeline engine: a clear error on EVERY rank naming the rank and the value,
never a hang (the spawn deadline would fail the test); and the ledger's byte count per step
equals the formula exactly."""
import pytest
import torch
import torch.nn as nn

import pipeline_parallel
from parity import pipeline as parity
from pipeline_parallel import PipelineError, PipelineModule
from pipeline_parallel.engine.model import lm_loss
from primitives import LEDGER
from primitives.engine.cost import traffic


class ShapeShifter(nn.Module):
    """Identity, except that from its 3rd call on it drops the last sequence position."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        self.calls += 1
        return x * self.w if self.calls < 3 else x[:, :-1] * self.w


def _engine(layers=None, pp=2, **cfg):
    pm = PipelineModule(layers or parity.make_layers(2), num_stages=pp, loss_fn=lm_loss, seed_layers=True)
    config = {**parity.ds_config(2, 4, 0.0, schedule="1f1b"), **cfg}
    return pipeline_parallel.initialize(model=pm, config=config)[0]


def _bad_inputs(rank, world):
    errors = {}
    try:                                              # 3 stages on 2 ranks
        pipeline_parallel.initialize(model=PipelineModule(parity.make_layers(2), num_stages=3, loss_fn=lm_loss),
                                     config=parity.ds_config(2, 4, 0.0))
    except Exception as e:
        errors["pp"] = str(e)
    try:
        _engine(gradient_accumulation_steps=0)
    except Exception as e:
        errors["m"] = str(e)
    engine = _engine()
    it = parity.data_iter(0, 0, 4 if engine.stage == 0 else 3, 2)   # the last stage's iterator is short
    try:
        engine.train_batch(it)
    except PipelineError as e:
        errors["dry"] = str(e)
    try:
        engine.train_batch(parity.data_iter(1, 0, 4, 2))
    except PipelineError as e:
        errors["broken"] = str(e)
    layers = parity.make_layers(2)
    layers.insert(2, ShapeShifter())                 # the last layer of stage 0
    pm = PipelineModule(layers, num_stages=2, loss_fn=lm_loss, partition_method=[0, 3, 6], seed_layers=True)
    engine = pipeline_parallel.initialize(model=pm, config=parity.ds_config(2, 4, 0.0))[0]
    try:
        engine.train_batch(parity.data_iter(0, 0, 4, 2))
    except PipelineError as e:
        errors["shape"] = str(e)
    return errors


def test_bad_input_is_an_error_on_every_rank(spawn):
    out = spawn(_bad_inputs, 2, timeout=240)
    for rank, errors in enumerate(out):
        assert f"rank {rank}: pp=3 stages × dp=world/pp does not divide the world size 2" in errors["pp"]
        assert "'gradient_accumulation_steps' = 0 is invalid" in errors["m"]
        assert errors["dry"].startswith(f"rank {rank}: the pipeline step failed on 1 rank(s)")
        assert "rank 1 (stage 1, replica 0)" in errors["dry"] and "ran dry at micro-batch 3 of 4" in errors["dry"]
        assert "failed in an earlier step" in errors["broken"]
        assert "rank 0 (stage 0, replica 0)" in errors["shape"]
        assert "output changed from shape (2, 16, 32)" in errors["shape"] and "(2, 15, 32)" in errors["shape"]
        assert "at micro-batch 2" in errors["shape"]


def _ledger(rank, world, m):
    engine = _engine(pp=2, gradient_accumulation_steps=m)
    engine.train_batch(parity.data_iter(0, engine.dp_rank, m, 2))       # first step: shape headers
    LEDGER.calls.clear()
    with LEDGER.track() as step:
        engine.train_batch(parity.data_iter(1, engine.dp_rank, m, 2))
    ar = [c for c in LEDGER.calls if c.name == "all_reduce" and c.nbytes == 4 * sum(p.numel() for p in engine.params)]
    return {"sent": step.bytes_sent, "msgs": step.msgs_sent, "stage": engine.stage, "dp_rank": engine.dp_rank,
            "psi": sum(p.numel() for p in engine.params), "algo": ar[0].algorithm if ar else None}


@pytest.mark.parametrize("m", [3])
def test_bytes_per_step_equal_the_formula(spawn, m):
    """pp = 2 × dp = 2: each rank sends m activations (stage 0) or m gradients (stage 1) of
    b·s·h·4 bytes, its tied-embedding gradient once (V·h·4) to the other holder, and its share of
    the ring/direct/... all-reduce of the stage's Ψ_s gradients over dp, as primitives.engine.cost
    prices it. Headers and the status all-reduce are control traffic, outside this count."""
    out = spawn(_ledger, 4, args=(m,))
    A = 2 * parity.SEQ * parity.DIM * 4
    tied = parity.VOCAB * parity.DIM * 4
    for r in out:
        _, ar_bytes = traffic("all_reduce", r["algo"], 2, r["dp_rank"], r["psi"], 4)
        assert r["algo"] is not None
        assert r["sent"] == m * A + tied + ar_bytes, r
