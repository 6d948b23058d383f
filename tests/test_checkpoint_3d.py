"""DeepSpeed's checkpoint descriptors served by ringzero (as_deepspeed/checkpoint_3d*.py) against the installed
DeepSpeed 0.19.8's own: the (pp, tp, dp) reshape on every contraction of shapes up to 4 x 4 x 4, the
descriptor of synthetic folders (recorded degrees, legacy counts, pipeline layer files, bad metadata), and
DeepSpeedCheckpoint reading folders ringzero's engine wrote on 2 ranks (ZeRO-1 bf16, ZeRO-2 fp32; ZeRO-3's,
which has no mp_rank_* file, refused by both with the same message).

    python -m pytest -q tests/test_checkpoint_3d.py          (~20 s on 2 cores: one 2-rank run)

Reference: the installed DeepSpeed's deepspeed.checkpoint, same process, same inputs; answers compared
exactly (integer file lists, file names, metadata, tensors with torch.equal: both sides only load and
concatenate, so any difference is a bug, not rounding). Where DeepSpeed raises, ringzero must raise the
same exception type with the same message.
"""
import itertools
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

pytest.importorskip("deepspeed")

from zero_from_scratch.as_deepspeed import checkpoint_3d as ours_3d  # noqa: E402
from zero_from_scratch.as_deepspeed.checkpoint_3d_reader import DeepSpeedCheckpoint as OursCheckpoint  # noqa: E402
from zero_from_scratch.as_deepspeed.checkpoint_3d_zero import ZeROCheckpoint as OursZeRO  # noqa: E402


@pytest.fixture(scope="module")
def theirs():
    from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed
    prepare_deepspeed()
    import deepspeed.checkpoint as ck
    assert ck.model_3d_desc.__module__ == "deepspeed.checkpoint.reshape_3d_utils"    # the installed one, not ours
    return ck


def _outcome(fn):
    """What a call gives: ("ok", value) or ("raised", exception type name, message)."""
    try:
        return ("ok", fn())
    except (AssertionError, RuntimeError, ValueError, KeyError, ZeroDivisionError, AttributeError) as e:
        return ("raised", type(e).__name__, str(e))


def _grids(result):
    return [(g.pp_degree, g.tp_degree, g.map) for g in result]


SHAPES = list(itertools.product((1, 2, 3, 4), repeat=3))


def test_reshape_equals_deepspeeds_on_every_contraction(theirs):
    compared = raised = 0
    for src in SHAPES:
        for tgt in SHAPES:
            if any(t > s for s, t in zip(src, tgt)):
                continue
            o = _outcome(lambda: _grids(ours_3d.model_3d_desc(*src).reshape(ours_3d.model_3d_desc(*tgt))))
            t = _outcome(lambda: _grids(theirs.model_3d_desc(*src).reshape(theirs.model_3d_desc(*tgt))))
            assert o == t, (src, tgt)
            compared += 1
            raised += o[0] == "raised"
    assert compared == 1000 and 0 < raised < compared     # uneven cuts (3 -> 2) fail on both sides


def test_descriptor_checks_equal_deepspeeds(theirs):
    for src, tgt in itertools.product(SHAPES[::7], SHAPES[::5]):
        a, b = ours_3d.model_3d_desc(*src), theirs.model_3d_desc(*src)
        assert a.can_reshape(ours_3d.model_3d_desc(*tgt)) == b.can_reshape(theirs.model_3d_desc(*tgt))
        assert a.is_valid(*tgt) == b.is_valid(*tgt)
        assert (a.get_desc(), a.world_size()) == (b.get_desc(), b.world_size())
    o = ours_3d.reshape_meg_2d_parallel(4, 4, 2, 2)
    t = theirs.reshape_meg_2d_parallel(4, 4, 2, 2)
    assert o.map == t.map and o.get_data() == t.get_data() and o.get_data(tp_index=1) == t.get_data(tp_index=1)


def _write_folder(d, n_model, n_dp, dims=None, prefix="bf16_", layers=0, layer_tp=1):
    os.makedirs(d, exist_ok=True)
    for mp in range(n_model):
        state = {"param_shapes": [{"w": torch.Size([2])}], "iteration": 7, "ds_config": {}}
        if dims is not None:
            state["checkpoint_parallel_dimensions"] = dims[mp] if isinstance(dims, list) else dims
        torch.save(state, os.path.join(d, f"mp_rank_{mp:02d}_model_states.pt"))
        for dp in range(n_dp):
            torch.save({"dp": dp, "mp": mp}, os.path.join(d, f"{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"))
    for layer in range(layers):
        for tp in range(layer_tp):
            torch.save({"weight": torch.full((2, 2), float(layer * 10 + tp))},
                       os.path.join(d, f"layer_{layer:02d}-model_{tp:02d}-model_states.pt"))


FOLDERS = {   # name → _write_folder arguments
    "recorded_pp2_tp2_dp3": dict(n_model=4, n_dp=3, dims={"pp_degree": 2, "tp_degree": 2}),
    "legacy_tp2_dp2": dict(n_model=2, n_dp=2),
    "legacy_fp32_dp12": dict(n_model=1, n_dp=12, prefix=""),           # dp ranks 10, 11 sort after 2
    "legacy_pipeline": dict(n_model=4, n_dp=2, layers=6, layer_tp=2),   # layer_01 files give tp = 2, pp = 2
    "missing": dict(n_model=2, n_dp=2, dims=[{"pp_degree": 2, "tp_degree": 1}, None]),
    "disagrees": dict(n_model=2, n_dp=2, dims=[{"pp_degree": 2, "tp_degree": 1}, {"pp_degree": 1, "tp_degree": 2}]),
    "not_a_dict": dict(n_model=1, n_dp=1, dims="pp2"),
    "bad_degree": dict(n_model=1, n_dp=1, dims={"pp_degree": True, "tp_degree": 1}),
    "count_mismatch": dict(n_model=2, n_dp=2, dims={"pp_degree": 2, "tp_degree": 2}),
}


def _reading(ck, d):
    """What a script reads off a checkpoint folder with DeepSpeed's two readers (relative paths)."""
    rel = lambda files: [os.path.relpath(f, d) for f in files]     # noqa: E731
    desc = ck.get_model_3d_descriptor(d)
    out = {"desc": (desc.pp_degree, desc.tp_degree, desc.dp_degree)}
    z = ck.ZeROCheckpoint(d)
    out["zero"] = [rel(z.get_files_for_rank(p, t, r)) for r in range(desc.dp_degree)
                   for p in range(desc.pp_degree) for t in range(desc.tp_degree)]
    c = ck.DeepSpeedCheckpoint(d)
    out["ck"] = (c.pp_degree, c.tp_degree, c.dp_degree, c.get_iteration(), rel(c.mp_rank_files), c.layer_keys,
                 c.pp_to_transformer_map, {k: [rel(x) for x in v] for k, v in c.transformer_file_map.items()},
                 {k: rel(v) for k, v in c.tp_to_embedding_map.items()},
                 [(os.path.relpath(f, d), m) for f, m in c.model_state_metadata])
    if c.layer_files:
        out["layers"] = (c.get_embedding_state(1), c.get_transformer_state(tp_index=0, pp_index=1))
    out["state"] = c.get_zero_checkpoint_state(0, 0, 0)
    return out


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_folder_descriptors_and_readers_equal_deepspeeds(theirs, tmp_path, name):
    d = str(tmp_path / name)
    _write_folder(d, **FOLDERS[name])
    ours, want = _outcome(lambda: _reading(ours_3d_namespace(), d)), _outcome(lambda: _reading(theirs, d))
    assert _equal(ours, want), (ours, want)


def ours_3d_namespace():
    """ringzero's objects under the names `deepspeed.checkpoint` gives them."""
    return SimpleNamespace(get_model_3d_descriptor=ours_3d.get_model_3d_descriptor, ZeROCheckpoint=OursZeRO,
                           DeepSpeedCheckpoint=OursCheckpoint)


CONFIGS = {"zero1_bf16": (1, True), "zero2_fp32": (2, False), "zero3_fp32": (3, False)}


def _train_and_save(rank, world, root):
    import zero_from_scratch
    for name, (stage, bf16) in CONFIGS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))    # 53 parameters: padded over 2 ranks
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
        engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        torch.manual_seed(1 + rank)
        for _ in range(2):
            x = torch.randn(2, 6, dtype=torch.bfloat16 if bf16 else torch.float32)
            engine.backward(engine(x).float().square().mean())
            engine.step()
        engine.save_checkpoint(os.path.join(root, name), tag="t", client_state={"iteration": 2})


def _equal(a, b):
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):     # a pickled object (the loss scaler): ours
        return type(a).__name__ == type(b).__name__ and _equal(vars(a), vars(b))   # a ds_pickle stand-in
    return a == b


def _read_engine_folder(ck, d, **degrees):
    c = ck.DeepSpeedCheckpoint(d, **degrees)
    out = [c.pp_degree, c.tp_degree, c.dp_degree, c.original_world_size, c.world_size,
           [os.path.basename(f) for f in c.mp_rank_files], c.get_iteration(), c.get_args(),
           c.get_checkpoint_info("universal_checkpoint_info"), c.get_checkpoint_info(), c.model_state_metadata,
           c.get_2d_parallel_state(tp_index=0, pp_index=0)]
    for dp in range(c.dp_degree):
        out.append([os.path.basename(f) for f in c.get_zero_files(0, 0, dp)])
        for strip in (False, True):
            out.append(_outcome(lambda: c.get_zero_checkpoint_state(0, 0, dp, strip_tensor_paddings=strip)))
    return out


def test_deepspeedcheckpoint_reads_ringzeros_2rank_folder_as_deepspeeds(theirs, spawn, tmp_path):
    root = str(tmp_path)
    spawn(_train_and_save, 2, args=(root,))
    for name, degrees in itertools.product(CONFIGS, ({}, {"dp_degree": 1})):     # as saved; dp 2 read as dp 1
        d = os.path.join(root, name, "t")
        if name.startswith("zero3"):    # ZeRO-3 writes no mp_rank_* file: DeepSpeed's reader refuses the folder
            ours, want = (_outcome(lambda: _read_engine_folder(ck, d, **degrees)) for ck in (ours_3d_namespace(), theirs))
            assert ours == want and "Cannot find mp_rank_* files" in ours[2], (ours, want)
            continue
        ours = _read_engine_folder(ours_3d_namespace(), d, **degrees)
        want = _read_engine_folder(theirs, d, **degrees)
        assert ours[:3] == [1, 1, 2 if not degrees else 1], name
        assert len(ours) == len(want), name
        for i, (a, b) in enumerate(zip(ours, want)):
            assert _equal(a, b), (name, degrees, i, a, b)
        if not degrees:     # each dp rank's own state read (merging two ranks' 0-dim `step`s fails on both sides)
            assert ours[-2][0] == "ok", (name, ours[-2])


def _write_merge_folder(d):
    """A dp=2 fp32 ZeRO-2 folder whose files carry what a merge touches: per-param optimizer tensors padded
    differently on each rank, a python-int `step`, group_paddings, partition_count, nested lists and a tuple."""
    os.makedirs(d)
    torch.save({"param_shapes": [{"w": torch.Size([9])}], "iteration": 3, "ds_config": {}},
               os.path.join(d, "mp_rank_00_model_states.pt"))
    for dp, pad in ((0, 1), (1, 2)):
        g = torch.Generator().manual_seed(dp)
        vec = lambda n: torch.randn(n, generator=g)      # noqa: E731
        state = {0: {"exp_avg": vec(5 + pad), "exp_avg_sq": vec(5 + pad), "step": 4},
                 1: {"exp_avg": vec(3 + pad), "exp_avg_sq": vec(3 + pad), "step": 4}}
        osd = {"base_optimizer_state": {"state": state, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
               "single_partition_of_fp32_groups": [vec(8 + pad)], "group_paddings": [pad, pad],
               "partition_count": [2, 2], "zero_stage": 2, "nested": [[vec(2), 7], (vec(1), "x")]}
        torch.save({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": "0.19.8"},
                   os.path.join(d, f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"))


def test_a_successful_merge_from_dp2_to_dp1_equals_deepspeeds(theirs, tmp_path):
    """Both ranks' ZeRO files read as one dp rank: padding stripped per file, dicts / lists / tuples / 1-D
    tensors merged, partition_count rewritten to the target degree, group_paddings cleared."""
    d = str(tmp_path / "merge")
    _write_merge_folder(d)
    ours_ns = ours_3d_namespace()
    for strip in (True, False):
        got = []
        for ck, desc in ((ours_ns, ours_3d.model_3d_desc), (theirs, theirs.model_3d_desc)):
            z = ck.ZeROCheckpoint(d)
            z.reshape(desc(1, 1, 1))
            via_reader = ck.DeepSpeedCheckpoint(d, dp_degree=1).get_zero_checkpoint_state(0, 0, 0, strip)
            got.append((z.get_state_for_rank(0, 0, 0, keys_to_ignore=["ds_version"], strip_tensor_paddings=strip),
                        via_reader))
        assert _equal(got[0], got[1]), (strip, got)
        osd = got[0][0]["optimizer_state_dict"]
        assert "ds_version" not in got[0][0] and osd["partition_count"] == [1, 1]
        assert osd["group_paddings"] == ([0, 0] if strip else [1, 1])      # unstripped: rank 0's kept
        assert osd["base_optimizer_state"]["state"][0]["exp_avg"].numel() == (10 if strip else 13)
        assert osd["base_optimizer_state"]["state"][0]["step"] == 4 and len(osd["nested"][0][0]) == 4
