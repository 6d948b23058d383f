"""DeepSpeed's universal checkpoint under the runner, against real DeepSpeed 0.19.8 as the reference.

    python -m pytest -q tests/test_checkpoint_universal.py              # ~1 min on 2 cores
    python -m pytest -q -m slow tests/test_checkpoint_universal.py      # ZeRO-2/3, bf16, 2 → 1, frozen: ~2 min

ringzero trains a 13-37-3 MLP at N = 2 and saves (its folders hold DeepSpeed's files, checkpoint_ds.py).
(a) real DeepSpeed's ds_to_universal and the runner's (`from deepspeed.checkpoint.ds_to_universal import
main` under `python -m zero_from_scratch.as_deepspeed`) convert the same folder: every file the same, every
tensor equal (dtype, shape, value) — both are copies of the saved fp32 values, so nothing may round.
(b) at N = 3 (or 1) a fresh DeepSpeed engine and a fresh ringzero engine, both with
"checkpoint": {"load_universal": true}, load the folder DeepSpeed's converter wrote: the loaded weights and
Adam moments are copies (equal exactly), and the next 3 losses agree to fp32 summation rounding (1e-6
relative: the losses themselves have measured equal; a different reduction order may move the last bits),
bf16 to 2e-3 relative (one bf16 ulp of a weight after a step, 2^-8 relative, moves the loss that much).
The files DeepSpeed classes pickled (its loss scaler) are read with ds_pickle.load_file,
so the ranks that run the served converter never import DeepSpeed (the runner's finder refuses once it is
imported); the pytest process imports it only to skip where it is absent.
"""
import os
import warnings
import sys
import textwrap

import pytest
import torch

from conftest import run_cmd
from parity.zero.universal_compare import GLOBAL_BATCH as GB, _train   # its batches: seeded per step, cut per rank
from zero_from_scratch.engine.ds_pickle import _Kept, load_file

pytest.importorskip("deepspeed")
SAVE_AT, TAG = 3, "global_step3"
HERE = os.path.dirname(os.path.abspath(__file__))


def _engine(side, stage, world, bf16, groups, universal):
    from parity.zero.ds_parity import make_config
    from parity.zero.sides import make_engine
    from zero_from_scratch.engine.models import TinyMLP, param_groups
    torch.manual_seed(0 if not universal else 1)       # the resumed weights must come from the folder
    model = TinyMLP()
    cfg = make_config(stage, micro_bs=GB // world, gas=1, bf16=bf16)
    if stage < 3:                                      # a ZeRO-3 key: ringzero warns on it below stage 3
        cfg["zero_optimization"].pop("stage3_param_persistence_threshold")
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if groups == 0:                                    # a frozen parameter and a buffer: no optimizer state
        model.fc1.bias.requires_grad_(False)
        model.register_buffer("scale", torch.arange(4.0))
    pg = param_groups(model, 0.1) if groups == 2 else [{"params": [p for p in model.parameters() if p.requires_grad]}]
    return make_engine(side, model, pg, cfg, "primitives")


def _save(rank, world, root, jobs):
    for name, stage, bf16, groups, *side in jobs:      # side: "ours" unless named
        e = _engine((side or ["ours"])[0], stage, world, bf16, groups, False)
        _train(e, range(1, SAVE_AT + 1), rank, world)
        e.save_checkpoint(os.path.join(root, name), tag=TAG, client_state={"universal_checkpoint_info": {}})


def _resume(rank, world, folder, stage, bf16, groups, uc_tag, runner=False):
    """runner: ringzero's engine takes the runner's DeepSpeed quirk for this load (quirks.shared_step_load)."""
    from parity.zero.sides import full_params
    from zero_from_scratch.as_deepspeed import quirks
    out = {}
    for side in ("deepspeed", "ours"):
        e = _engine(side, stage, world, bf16, groups, True)
        if side == "ours" and runner:
            quirks.shared_step_load(e)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path, client = e.load_checkpoint(folder, tag=uc_tag)
        if side == "deepspeed":
            from deepspeed.utils import safe_get_full_optimizer_state as get
        else:
            from zero_from_scratch.engine.safe_api import safe_get_full_optimizer_state as get
        moments = {n: [get(p, k).float().clone() for k in ("exp_avg", "exp_avg_sq")]
                   for n, p in e.module.named_parameters()}
        opt = e.optimizer.optimizer if side == "deepspeed" else e.optimizer     # DeepSpeed's wraps torch's
        out[side] = dict(params=full_params(side, e, stage), moments=moments, client=sorted(client),
                         shared_step_warned=any("one shared step tensor" in str(w.message) for w in caught),
                         path=os.path.basename(path), global_steps=e.global_steps,
                         hyper=[(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in opt.param_groups],
                         losses=_train(e, [SAVE_AT + 1], rank, world))
        st = opt.state.values() if side == "deepspeed" else e.optimizer.state       # each group's Adam step
        out[side]["steps_after_one"] = [int(v["step"]) for v in st]
        out[side]["losses"] += _train(e, range(SAVE_AT + 2, SAVE_AT + 4), rank, world)
        out[side]["lr"] = e.lr_scheduler.get_last_lr()
    return out


def _convert_both(ckpts: dict) -> dict:
    """Real DeepSpeed's converter (one subprocess) and the runner's (one subprocess each) on every folder;
    returns {name: (DeepSpeed's output folder, ringzero's)}."""
    out, calls = {}, []
    for name, root in ckpts.items():
        src = os.path.join(root, TAG)
        out[name] = (os.path.join(root, f"{TAG}_ds"), os.path.join(root, f"{TAG}_rz"))
        calls.append(f"main(SimpleNamespace(input_folder={src!r}, output_folder={out[name][0]!r}, "
                     "num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True, "
                     "inject_missing_state=False))")
    code = "from types import SimpleNamespace\nfrom deepspeed.checkpoint.ds_to_universal import main\n" + "\n".join(calls)
    run_cmd(f"{sys.executable} -c {_q(code)}")
    script = os.path.join(os.path.dirname(next(iter(ckpts.values()))), "convert.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent("""\
            from deepspeed.checkpoint.ds_to_universal import main, parse_arguments
            main(parse_arguments())
            """))
    for name, root in ckpts.items():
        r = run_cmd(f"{sys.executable} -m zero_from_scratch.as_deepspeed {script} --input_folder {root}/{TAG} "
                    f"--output_folder {out[name][1]}")
        assert "ringzero" in r.stderr and "*** Done!" in r.stdout, r.stderr[-2000:]
    return out


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _files(d):
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


def _same(a, b, where=""):
    """Every tensor equal in dtype, shape and value; DeepSpeed's pickled objects by class name and attributes."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max |Δ| {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, _Kept):
        assert type(a)._deepspeed_name == type(b)._deepspeed_name, where
        _same(vars(a), vars(b), f"{where}.{type(a).__name__}")
    else:
        assert a == b and getattr(type(a), "_deepspeed_name", None) == getattr(type(b), "_deepspeed_name", None), \
            f"{where}: {a!r} vs {b!r}"


def _assert_same_folder(ds_dir, rz_dir):
    assert _files(ds_dir) == _files(rz_dir)
    for f in _files(ds_dir):
        _same(load_file(os.path.join(ds_dir, f)), load_file(os.path.join(rz_dir, f)), f)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """ringzero's N=2 checkpoints (ZeRO-1 two param groups, ZeRO-3 one group), each converted twice."""
    from primitives.launch import spawn
    root = str(tmp_path_factory.mktemp("uc"))
    jobs = [("z1", 1, False, 2), ("z3", 3, False, 1)]
    spawn(_save, 2, args=(root, jobs), timeout=300)
    return {name: (os.path.join(root, name), *conv)
            for name, conv in _convert_both({n: os.path.join(root, n) for n, *_ in jobs}).items()}


@pytest.mark.parametrize("name", ["z1", "z3"])
def test_served_converter_writes_deepspeeds_files(folders, name):
    root, ds_dir, rz_dir = folders[name]
    _assert_same_folder(ds_dir, rz_dir)
    assert open(os.path.join(root, "latest_universal")).read() == os.path.basename(rz_dir)   # the last to run


@pytest.mark.slow
def test_served_converter_reads_folders_real_deepspeed_wrote(tmp_path):
    """Real DeepSpeed trains and saves at N = 2 (fp32, two param groups; ZeRO-1 and ZeRO-3): the runner's converter
    reads its files and writes the folder DeepSpeed's own converter writes, every tensor equal."""
    from primitives.launch import spawn
    jobs = [("d1", 1, False, 2, "deepspeed"), ("d3", 3, False, 2, "deepspeed")]
    spawn(_save, 2, args=(str(tmp_path), jobs), timeout=300)
    for name, (ds_dir, rz_dir) in _convert_both({n: str(tmp_path / n) for n, *_ in jobs}).items():
        assert any(f.endswith("exp_avg.pt") for f in _files(rz_dir)), name
        _assert_same_folder(ds_dir, rz_dir)


def test_runner_dash_m_runs_deepspeeds_converter_command(folders, tmp_path):
    """python -m zero_from_scratch.as_deepspeed -m deepspeed.checkpoint.ds_to_universal ..., as DeepSpeed users run
    it with python -m: the files real DeepSpeed's converter wrote; a module with no served command line refused."""
    root, ds_dir, _ = folders["z1"]
    out = str(tmp_path / "dash_m")
    r = run_cmd(f"{sys.executable} -m zero_from_scratch.as_deepspeed -m deepspeed.checkpoint.ds_to_universal "
                f"--input_folder {root}/{TAG} --output_folder {out}")
    assert "*** Done!" in r.stdout and "ringzero" in r.stderr, r.stderr[-2000:]
    _assert_same_folder(ds_dir, out)
    r = run_cmd(f"{sys.executable} -m zero_from_scratch.as_deepspeed -m deepspeed.launcher.runner", check=False)
    assert r.returncode != 0 and "ringzero serves no command line for it" in r.stderr
    assert "-m MODULE" in run_cmd(f"{sys.executable} -m zero_from_scratch.as_deepspeed --help").stdout


def _check_resume(res, bf16=False, all_losses=True, steps=SAVE_AT + 1):
    for rank_res in res:                      # every rank: its gathered view of the loaded state
        ds, rz = rank_res["deepspeed"], rank_res["ours"]
        for n in ds["params"]:
            assert torch.equal(ds["params"][n], rz["params"][n]), n
            for a, b in zip(ds["moments"][n], rz["moments"][n]):
                assert torch.equal(a, b), n
        for k in ("client", "path", "global_steps", "hyper", "lr"):
            assert ds[k] == rz[k], k
        tol = 2e-3 if bf16 else 1e-6
        assert ds["losses"][0] == pytest.approx(rz["losses"][0], rel=tol)      # same weights: same first loss
        if all_losses:
            assert ds["steps_after_one"] == rz["steps_after_one"] == [steps] * len(ds["steps_after_one"])
            assert rz["losses"] == pytest.approx(ds["losses"], rel=tol)


def test_load_universal_zero1_2_to_3_equals_deepspeed(folders):
    from primitives.launch import spawn
    root = folders["z1"][0]
    _check_resume(spawn(_resume, 3, args=(root, 1, False, 2, f"{TAG}_ds"), timeout=300))


@pytest.mark.slow
def test_load_universal_zero3_2_to_3_equals_deepspeed(folders):
    from primitives.launch import spawn
    _check_resume(spawn(_resume, 3, args=(folders["z3"][0], 3, False, 1, f"{TAG}_ds"), timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16,world", [(2, False, 1), (2, True, 3), (3, True, 3)])
def test_convert_and_load_more_stages(tmp_path, stage, bf16, world):
    from primitives.launch import spawn
    name = f"z{stage}{'b' if bf16 else ''}"
    spawn(_save, 2, args=(str(tmp_path), [(name, stage, bf16, 2 if stage < 3 else 1)]), timeout=300)
    root = str(tmp_path / name)
    ds_dir, rz_dir = _convert_both({name: root})[name]
    _assert_same_folder(ds_dir, rz_dir)
    _check_resume(spawn(_resume, world, args=(root, stage, bf16, 2 if stage < 3 else 1, f"{TAG}_rz"), timeout=300),
                  bf16)


@pytest.mark.slow
def test_zero3_two_groups_shared_step_under_runner_own_steps_outside(tmp_path):
    """DeepSpeed's ZeRO-3 universal load gives every sub-group state[0]'s step tensor itself; torch's Adam
    advances it once per group, so one step after the load both groups read SAVE_AT + 2 (a decay and a no-decay
    group, as the HF Trainer builds them). Under the runner ringzero steps the same way: the same steps and the
    same losses (1e-6 relative, fp32). Its own entry point keeps one step per group (SAVE_AT + 1), and rank 0
    warns that DeepSpeed's later losses differ."""
    from primitives.launch import spawn
    spawn(_save, 2, args=(str(tmp_path), [("z3g2", 3, False, 2)]), timeout=300)
    root = str(tmp_path / "z3g2")
    _convert_both({"z3g2": root})
    res = spawn(_resume, 2, args=(root, 3, False, 2, f"{TAG}_ds", True), timeout=300)
    _check_resume(res, steps=SAVE_AT + 2)
    print("runner, max relative Δloss vs DeepSpeed over ranks and steps:", max(   # pytest -s shows it
        abs(a - b) / abs(a) for r in res for a, b in zip(r["deepspeed"]["losses"], r["ours"]["losses"])))
    assert not any(r["ours"]["shared_step_warned"] for r in res)
    res = spawn(_resume, 2, args=(root, 3, False, 2, f"{TAG}_ds", False), timeout=300)
    _check_resume(res, all_losses=False)
    for r in res:
        assert r["deepspeed"]["steps_after_one"] == [SAVE_AT + 2] * 2
        assert r["ours"]["steps_after_one"] == [SAVE_AT + 1] * 2
        assert r["ours"]["losses"][1:] != pytest.approx(r["deepspeed"]["losses"][1:], rel=1e-6)
    print("own entry, max relative Δloss vs DeepSpeed:", max(
        abs(a - b) / abs(a) for r in res for a, b in zip(r["deepspeed"]["losses"], r["ours"]["losses"])))
    assert res[0]["ours"]["shared_step_warned"] and not res[1]["ours"]["shared_step_warned"]   # rank 0 says so


def test_converter_refusals_and_deepspeeds_errors(folders, tmp_path):
    """DeepSpeed's own errors (its texts, ds_to_universal.py) and ringzero's one-line refusals."""
    import shutil
    from zero_from_scratch.as_deepspeed.ds_to_universal import main, parse_arguments
    src = os.path.join(folders["z1"][0], TAG)
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    model_file = bare / "mp_rank_00_model_states.pt"
    sd = torch.load(model_file, weights_only=False)
    del sd["universal_checkpoint_info"]
    torch.save(sd, model_file)
    args = parse_arguments(["--input_folder", str(bare), "--output_folder", str(tmp_path / "out")])
    with pytest.raises(AssertionError, match="Required universal_checkpoint_info state is missing"):
        main(args)
    main(parse_arguments(["--input_folder", str(bare), "--output_folder", str(tmp_path / "out"),
                          "--inject_missing_state"]))      # DeepSpeed's way around it
    shutil.copy(model_file, bare / "mp_rank_01_model_states.pt")
    with pytest.raises(NotImplementedError, match="tensor-parallel slices: .*merge_tp_slices"):
        main(args)
    with pytest.raises(FileNotFoundError, match="can't find \\*_optim_states.pt files"):
        main(parse_arguments(["--input_folder", str(tmp_path), "--output_folder", str(tmp_path / "o2")]))


SUBSET = """
from types import SimpleNamespace
import deepspeed.checkpoint.ds_to_universal as m
orig = m._get_optim_files
m._get_optim_files = lambda d: orig(d)[:1]             # rank 0's file only
try:
    m.main(SimpleNamespace(input_folder={src!r}, output_folder={out!r}, num_extract_workers=1, num_merge_workers=1,
                           keep_temp_folder=False, strict=True, inject_missing_state=False))
except RuntimeError as e:
    print("RuntimeError", e)
"""


def test_converter_reads_the_optimizer_files_main_listed(folders, tmp_path):
    """ZeRO-3: both converters read the optimizer files _get_optim_files listed, so a script's replacement
    returning a subset is seen: DeepSpeed's degree check against the model files fails, in its words."""
    src = os.path.join(folders["z3"][0], TAG)
    ds = run_cmd(f"{sys.executable} -c {_q(SUBSET.format(src=src, out=str(tmp_path / 'ds')))}").stdout
    script = tmp_path / "subset.py"
    script.write_text(SUBSET.format(src=src, out=str(tmp_path / "rz")))
    rz = run_cmd(f"{sys.executable} -m zero_from_scratch.as_deepspeed {script}").stdout
    want = "RuntimeError ZeRO-3 model/optimizer tp_degree or dp_degree mismatch: model=(1,2), optim=(1,1)"
    assert want in ds and want in rz, (ds, rz)


def _refusals(rank, world, folder):
    out = []
    for stage, tag in ((0, f"{TAG}_ds"), (1, None)):
        e = _engine("ours", stage, world, False, 2, True)
        try:
            e.load_checkpoint(folder if tag else os.path.dirname(folder), tag=tag)
        except (NotImplementedError, ValueError) as err:
            out.append(f"{type(err).__name__}: {err}")
    return out


def test_loader_refusals(folders):
    from primitives.launch import spawn
    stage0, no_latest = spawn(_refusals, 1, args=(folders["z1"][0],), timeout=120)[0]
    assert stage0.startswith("NotImplementedError") and "load_universal at ZeRO stage 0 is not served" in stage0
    assert no_latest.startswith("ValueError: Invalid for universal checkpoint") and "latest_universal does not exist" in no_latest


@pytest.mark.slow
def test_converter_frozen_parameter_and_buffer(tmp_path):
    """A frozen parameter and a buffer have no optimizer state: at ZeRO-1/2 both converters write their module
    value as fp32.pt, at ZeRO-3 neither writes them (DeepSpeed's stage-3 path reads optimizer files only)."""
    from primitives.launch import spawn
    spawn(_save, 2, args=(str(tmp_path), [("f1", 1, False, 0), ("f3", 3, False, 0)]), timeout=300)
    out = _convert_both({n: str(tmp_path / n) for n in ("f1", "f3")})
    for name, (ds_dir, rz_dir) in out.items():
        _assert_same_folder(ds_dir, rz_dir)
        assert os.path.isfile(os.path.join(rz_dir, "zero", "scale", "fp32.pt")) == (name == "f1")


def test_zero3_shared_step_only_where_each_group_is_one_deepspeed_sub_group():
    """DeepSpeed's stage3.py _create_fp16_sub_groups cuts a group whose partition numel exceeds sub_group_size
    after each whole parameter that reaches it; each piece would step at its own count of the shared step, which
    one step per group cannot follow: there (and at ringzero's own entry point) rank 0 warns and steps stay per
    group. An int step (FusedAdam's, DeepSpeedCPUAdam's) is not shared: each sub-group's `+= 1` rebinds its own
    entry, so one step per group is DeepSpeed's behaviour, with no warning."""
    from types import SimpleNamespace as NS
    from zero_from_scratch.engine.checkpoint_universal import _shared_step_order
    numels = {"a": 16, "b": 16, "c": 4, "d": 6}         # partitions at N = 2: 8, 8, 2, 3
    e = NS(group_names=[["a", "b"], [], ["c", "d"]], config=NS(sub_group_size=16), comm=NS(size=2, global_rank=0),
           ds_shared_step=True)
    tensor_step = torch.tensor(3.0)                      # torch's Adam saves its step as a tensor
    assert _shared_step_order(e, numels, tensor_step) == [0, 2]     # 16 ≥ 8 + 8: two groups, two sub-groups
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _shared_step_order(e, numels, 3) is None     # int: DeepSpeed's groups count separately
        e.config.sub_group_size = 8
        assert _shared_step_order(e, numels, 3) is None
    with pytest.warns(UserWarning, match="its 3 sub-groups one shared step tensor.*sub_group_size .8. steps in pieces"):
        assert _shared_step_order(e, numels, tensor_step) is None   # group 0 → [a], [b]
    e.config.sub_group_size, e.ds_shared_step = 16, False
    with pytest.warns(UserWarning, match="DeepSpeed would give its 2 sub-groups one shared step tensor"):
        assert _shared_step_order(e, numels, tensor_step) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _shared_step_order(e, numels, 3) is None
