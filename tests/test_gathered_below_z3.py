"""deepspeed.zero.GatheredParameters(modifier_rank=r) at ZeRO stages 0-2 under the runner, against DeepSpeed 0.19.8.

    python -m pytest -q tests/test_gathered_below_z3.py      (2 spawned ranks, gloo; seconds)

The same script on both sides (real DeepSpeed's initialize and GatheredParameters; the runner's initialize
and the class it serves for `deepspeed.zero.GatheredParameters`), in the same 2 processes: after initialize at
stage 0, 1, 2 in fp32 and bf16, rank 1 fills a weight with 0.5 inside GatheredParameters(modifier_rank=1),
then a read-only block (modifier_rank=None), then one forward, backward and step. DeepSpeed's block is a
no-op on parameters without a ds_id (partition_parameters.py GatheredParameters.__init__), so rank 1 alone
holds the edit: each rank's weight after the blocks, and its loss, must be the runner's, exactly.
After the step (the edit moved that rank's gradient; the step all-reduces it) the weights are compared where
both sides keep the same master: stage 0 (fp32: the torch optimizer steps the edited weight on its rank; bf16:
the fp32 master never saw the edit and overwrites it) and stages 1-2 in bf16 (the same). Stages 1-2 in fp32
are left out there: DeepSpeed's fp32 partition is a clone the edit never reaches, ringzero's master is the
parameter buffer itself, so the editing rank's owned shard keeps its edit (a difference of any in-place
edit after initialize, not of this block). The warning: once, on rank 0 only.
"""
import logging

import pytest
import torch
import torch.nn as nn

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

CASES = [(s, bf16) for s in (0, 1, 2) for bf16 in (False, True)]


def _run(side, stage, bf16, rank):
    import deepspeed
    from zero_from_scratch.as_deepspeed import served, top
    from zero_from_scratch.as_deepspeed.finder import resolve
    name = "deepspeed.zero.GatheredParameters"
    init, gathered = ((deepspeed.initialize, deepspeed.zero.GatheredParameters) if side == "deepspeed"
                      else (top.initialize, resolve(name, served.SERVED[name])))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16}, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = init(model=m, config=cfg, model_parameters=m.parameters())
    with gathered(m[0].weight, modifier_rank=1):
        if rank == 1:
            m[0].weight.data.fill_(0.5)
    with gathered(m.parameters()):
        inside = [p.detach().clone() for p in m.parameters()]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank)).to(m[0].weight.dtype)
    loss = engine(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    return inside, loss.item(), [p.detach().clone() for p in m.parameters()]


def _both(rank, world):
    import warnings
    warnings.filterwarnings("ignore")
    from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed
    from zero_from_scratch.as_deepspeed.utils import logger
    prepare_deepspeed()
    logger.setLevel(logging.WARNING)     # prepare_deepspeed quiets the "DeepSpeed" logger both sides share
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage()) if "modifier_rank" in record.getMessage() else None
    logger.addHandler(handler)
    out = {c: {s: _run(s, *c, rank) for s in ("deepspeed", "runner")} for c in CASES}
    logger.removeHandler(handler)
    return out, said


def test_modifier_rank_below_zero3_leaves_edits_where_deepspeed_does(spawn):
    res = spawn(_both, 2)
    for rank, (out, said) in enumerate(res):
        for (stage, bf16), sides in out.items():
            (ds_in, ds_loss, ds_after), (rz_in, rz_loss, rz_after) = sides["deepspeed"], sides["runner"]
            case = (rank, stage, bf16)
            assert all(torch.equal(a, b) for a, b in zip(ds_in, rz_in)), case
            assert torch.equal(rz_in[0], torch.full_like(rz_in[0], 0.5)) == (rank == 1), case   # edit stayed local
            assert rz_loss == ds_loss, case
            if stage == 0 or bf16:
                assert all(torch.equal(a, b) for a, b in zip(ds_after, rz_after)), case
        assert len(said) == (1 if rank == 0 else 0), (rank, said)
