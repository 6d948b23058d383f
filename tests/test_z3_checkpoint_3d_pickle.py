"""The runner's ZeROCheckpoint (as_deepspeed/checkpoint_3d_zero.py) reads DeepSpeed's pickled objects.

    python -m pytest -q tests/test_z3_checkpoint_3d_pickle.py          (one 1-rank process: seconds)
    python -m pytest -q -m slow tests/test_z3_checkpoint_3d_pickle.py  (a folder real DeepSpeed saves: ~1 min)

DeepSpeed's optimizer files pickle its own objects (the loss scaler, ZeroStageEnum). Under the runner
`deepspeed` is ringzero's, so a plain torch.load of them fails importing DeepSpeed's classes; the reader
goes through engine/ds_pickle.py's one unpickler, which reads them as stand-ins keeping their attributes.
Quick: a folder whose optimizer file names DeepSpeed's two classes, against what was written. Slow: real
DeepSpeed 0.19.8 trains one step at ZeRO-2 and saves; its own ZeROCheckpoint, in the process that saved,
is the reference. States are compared as trees: tensors with torch.equal (both sides only load and
concatenate), DeepSpeed objects by class name and attributes, ZeroStageEnum as its int.
"""
import importlib.util
import os

import pytest
import torch
import torch.nn as nn

from primitives.launch import spawn
from zero_from_scratch.engine.ds_pickle import DS_PICKLE

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
       "zero_optimization": {"stage": 2}}


def _tree(v):
    """A state as plain values: what a pickle across processes (without DeepSpeed) can carry, and compare."""
    if isinstance(v, dict):
        return {k: _tree(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_tree(x) for x in v]
    if torch.is_tensor(v) or v is None or isinstance(v, (int, float, str)):
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else v    # ZeroStageEnum: its int
    return ("object", type(v).__name__, _tree(dict(vars(v))))


def _save_and_read(rank, world, d):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("deepspeed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(d, tag="t")
    from deepspeed.checkpoint import ZeROCheckpoint
    return _tree(ZeROCheckpoint(os.path.join(d, "t")).get_state_for_rank(0, 0, 0))


def _read_served(rank, world, d):
    from tests.ds_unit.harness import import_deepspeed
    import_deepspeed("ringzero")
    from deepspeed.checkpoint import ZeROCheckpoint
    assert ZeROCheckpoint.__module__.startswith("zero_from_scratch")
    return _tree(ZeROCheckpoint(os.path.join(d, "t")).get_state_for_rank(0, 0, 0))


def _equal(a, b, at="state"):
    assert type(a) is type(b), (at, type(a), type(b))
    if isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), at
        for k in a:
            _equal(a[k], b[k], f"{at}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{at}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), at
    else:
        assert a == b, (at, a, b)


class LossScaler:
    """Pickled under DeepSpeed's name (ds_pickle's writer), as DeepSpeed's optimizer files hold its scaler."""
    _deepspeed_name = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")


class ZeroStageEnum(int):
    _deepspeed_name = ("deepspeed.runtime.zero.config", "ZeroStageEnum")


def test_served_zerocheckpoint_reads_deepspeeds_pickled_classes(tmp_path):
    scaler = LossScaler()
    scaler.cur_scale, scaler.dynamic = 1.0, False
    exp_avg, fp32 = torch.arange(5.0), torch.linspace(-1, 1, 5)
    os.makedirs(tmp_path / "t")
    torch.save({"module": {"w": fp32}, "ds_version": "0.19.8"}, tmp_path / "t" / "mp_rank_00_model_states.pt")
    osd = {"loss_scaler": scaler, "zero_stage": ZeroStageEnum(2), "partition_count": [1], "group_paddings": [0],
           "base_optimizer_state": {"state": {0: {"exp_avg": exp_avg}}, "param_groups": [{"lr": 0.01}]},
           "single_partition_of_fp32_groups": [fp32]}
    torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"},
               tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", pickle_module=DS_PICKLE)
    got = spawn(_read_served, 1, args=(str(tmp_path),), timeout=120)[0]["optimizer_state_dict"]
    assert got["loss_scaler"] == ("object", "LossScaler", {"cur_scale": 1.0, "dynamic": False})
    assert got["zero_stage"] == 2
    _equal(got["base_optimizer_state"]["state"], {0: {"exp_avg": exp_avg}})
    _equal(got["single_partition_of_fp32_groups"], [fp32])


@pytest.mark.slow
def test_served_zerocheckpoint_reads_real_deepspeeds_optimizer_files(tmp_path):
    theirs = spawn(_save_and_read, 1, args=(str(tmp_path),), timeout=300)[0]
    ours = spawn(_read_served, 1, args=(str(tmp_path),), timeout=120)[0]
    osd = theirs["optimizer_state_dict"]
    assert osd["loss_scaler"][:2] == ("object", "LossScaler") and osd["zero_stage"] == 2   # what needed the unpickler
    _equal(ours, theirs)
