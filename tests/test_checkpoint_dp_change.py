"""A ZeRO-2 checkpoint saved at N = 2 loaded at N = 1 under the runner, against real DeepSpeed 0.19.8.

    python -m pytest -q tests/test_checkpoint_dp_change.py              # ~20 s on 2 cores

Both engines train a 13-37-3 MLP for 3 steps at N = 2 and save (each its own folder). At N = 1, as
DeepSpeed's runtime/engine.py::_load_zero_checkpoint: load_checkpoint with optimizer states raises
ZeRORuntimeException, the same message on both sides (quirks.dp_change_load; ringzero's own entry keeps
its CheckpointError asking for reshard=True); without them the weights load: equal to the saved ones
exactly (copies), and the next loss of both engines agrees to fp32 summation rounding (1e-6 relative).
In bf16 without optimizer states both set the fp32 master from the loaded bf16 weights, bit for bit.
"""
import os

import pytest
import torch

from parity.zero.universal_compare import _batch, _train
from test_checkpoint_universal import SAVE_AT, TAG, _engine

pytest.importorskip("deepspeed")
SIDES = ("deepspeed", "ours")


def _save(rank, world, root):
    from parity.zero.sides import full_params
    out = {}
    for side in SIDES:
        e = _engine(side, 2, world, False, 2, False)
        _train(e, range(1, SAVE_AT + 1), rank, world)
        e.save_checkpoint(os.path.join(root, side), tag=TAG)
        out[side] = full_params(side, e, 2)
    return out


def _load(rank, world, root):
    from parity.zero.sides import full_params
    from zero_from_scratch.as_deepspeed import quirks
    from zero_from_scratch.engine.checkpoint_read import CheckpointError
    out = {}
    for side in SIDES:
        e = _engine(side, 2, world, False, 2, False)
        quirks.dp_change_load(e) if side == "ours" else None
        with pytest.raises(Exception) as err:
            e.load_checkpoint(os.path.join(root, side), tag=TAG)
        e = _engine(side, 2, world, False, 2, False)
        quirks.dp_change_load(e) if side == "ours" else None
        e.load_checkpoint(os.path.join(root, side), tag=TAG, load_optimizer_states=False)
        x, y = _batch(SAVE_AT + 1, rank, world)
        out[side] = dict(err=(type(err.value).__name__, str(err.value)), params=full_params(side, e, 2),
                         loss=float(e(x, y).loss))
    own = _engine("ours", 2, world, False, 2, False)      # ringzero's own entry point
    with pytest.raises(CheckpointError, match="reshard=True"):
        own.load_checkpoint(os.path.join(root, "ours"), tag=TAG, load_optimizer_states=False)
    return out


def test_change_dp_load_equals_deepspeed(tmp_path, spawn):
    saved = spawn(_save, 2, args=(str(tmp_path),))[0]
    res = spawn(_load, 1, args=(str(tmp_path),))[0]
    ds, rz = res["deepspeed"], res["ours"]
    assert ds["err"] == rz["err"] and ds["err"][0] == "ZeRORuntimeException"
    assert "DP world size of 2 but the current world size is 1" in rz["err"][1]
    for side in SIDES:
        for n, p in saved[side].items():
            assert torch.equal(res[side]["params"][n], p), (side, n)
    assert rz["loss"] == pytest.approx(ds["loss"], rel=1e-6)


def _masters(side, engine) -> dict:
    if side == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param as get
    else:
        from zero_from_scratch.engine.safe_api import safe_get_full_fp32_param as get
    return {n: get(p).detach().float().clone() for n, p in engine.module.named_parameters()}


def _bf16_round_trip(rank, world, root, phase):
    """bf16 ZeRO-2: save at N = 2 (each side's fp32 master), or load at N = 1 without optimizer states."""
    from parity.zero.sides import full_params
    from zero_from_scratch.as_deepspeed import quirks
    out = {}
    for side in SIDES:
        e = _engine(side, 2, world, True, 2, False)
        if phase == "save":
            _train(e, range(1, SAVE_AT + 1), rank, world)
            e.save_checkpoint(os.path.join(root, side), tag=TAG)
            out[side] = _masters(side, e)
            continue
        quirks.dp_change_load(e) if side == "ours" else None
        e.load_checkpoint(os.path.join(root, side), tag=TAG, load_optimizer_states=False)
        out[side] = dict(master=_masters(side, e), params=full_params(side, e, 2))
    return out


def test_change_dp_load_without_optimizer_states_takes_the_master_from_the_bf16_weights(tmp_path, spawn):
    """DeepSpeed's engine reads no ZeRO file without optimizer states and sets the fp32 master from
    the loaded bf16 weights (_restore_from_bit16_weights): under the runner ringzero does the same,
    so the master is each weight upcast, not the saved master (which holds bits bf16 drops)."""
    saved = spawn(_bf16_round_trip, 2, args=(str(tmp_path), "save"))[0]
    res = spawn(_bf16_round_trip, 1, args=(str(tmp_path), "load"))[0]
    for side in SIDES:
        assert any(not torch.equal(m, m.bfloat16().float()) for m in saved[side].values()), side  # the control
        for n, p in res[side]["params"].items():
            assert torch.equal(res[side]["master"][n], p), (side, n)
    for n in res["ours"]["master"]:
        assert torch.equal(res["ours"]["master"][n], res["deepspeed"]["master"][n]), n
