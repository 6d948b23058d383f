"""The `deepspeed` runner's table: every served name, the modules, the not-served errors, the --list table.

    python -m pytest -x -q tests/test_as_deepspeed_names.py

The finder is installed in this process only inside the `served_ds` fixture (the real DeepSpeed's
modules, if an earlier test imported them, are set aside and put back); the other runner tests
(test_as_deepspeed_config.py, test_ds_serve_names.py) use the same fixture from here.
"""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from zero_from_scratch.as_deepspeed import finder, served
from zero_from_scratch.as_deepspeed.__main__ import split_argv

HERE = os.path.dirname(os.path.abspath(finder.__file__))


@pytest.fixture
def served_ds():
    """`import deepspeed` served by ringzero in this process, for the duration of one test."""
    real = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "deepspeed" or m.startswith("deepspeed.")}
    finder.install()
    try:
        yield importlib.import_module("deepspeed")
    finally:
        finder.uninstall()
        sys.modules.update(real)


def _lookup(ds, dotted: str):
    obj = ds
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_every_served_name_is_its_target_or_says_which_target_is_missing(served_ds):
    resolved = 0
    for name, target in served.SERVED.items():
        if name.endswith(".*"):
            continue
        mod, _, attr = target.partition(":")
        try:
            want = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            with pytest.raises(finder.NotServedAttributeError, match=f"{name.replace('.', '[.]')} is not served"):
                _lookup(served_ds, name)
            assert not hasattr(_lookup(served_ds, name.rpartition(".")[0]), name.rpartition(".")[2])
            continue
        assert _lookup(served_ds, name) is want, name
        resolved += 1
    assert resolved >= 15   # the runner's own names at least: initialize, comm, accelerator, utils


def test_no_name_is_both_served_by_its_own_entry_and_refused():
    from zero_from_scratch.as_deepspeed.served import REFUSED, SERVED
    assert not set(SERVED) & set(REFUSED)


def test_comm_serves_its_all_and_nothing_else(served_ds):
    from zero_from_scratch.as_deepspeed import comm
    import deepspeed.comm as ds_comm
    for n in comm.__all__:
        assert getattr(ds_comm, n) is getattr(comm, n)
    assert ds_comm.ReduceOp is dist.ReduceOp
    assert not hasattr(ds_comm, "_no_prof")
    with pytest.raises(finder.NotServedAttributeError, match="deepspeed.comm.primitives is not served"):
        ds_comm.primitives


def test_modules_are_ours_and_version_is_the_followed_api(served_ds):
    import deepspeed.accelerator
    import deepspeed.comm
    import deepspeed.utils.zero_to_fp32
    assert served_ds.__version__ == served.VERSION == "0.19.8"
    assert served_ds.__file__ == os.path.join(HERE, "top.py")
    assert deepspeed.comm.__file__ == os.path.join(HERE, "comm.py")
    assert deepspeed.utils.zero_to_fp32.__name__ == "deepspeed.utils.zero_to_fp32"
    assert all(isinstance(m, finder.ServedModule) for n, m in sys.modules.items() if n.split(".")[0] == "deepspeed")
    import importlib.util
    assert importlib.util.find_spec("deepspeed").origin.startswith(HERE)   # what accelerate's probe sees


def test_not_served_fails_at_first_use_with_one_line(served_ds):
    # a refused name imports (a client imports it at the top and may never use it), then fails when used
    from deepspeed.compression.compress import init_compression
    with pytest.raises(finder.NotServedError) as e:
        init_compression(torch.nn.Linear(1, 1), "ds.json")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("deepspeed.compression.compress.init_compression is not served")
    assert "DeepSpeed would" in msg and "nearest ringzero way:" in msg and "0.19.8" in msg
    assert not isinstance(torch.nn.Linear(1, 1), served_ds.DeepSpeedTransformerLayer)
    with pytest.raises(finder.NotServedAttributeError, match="nearest ringzero way"):
        served_ds.DeepSpeedTransformerLayer.some_attribute
    # an unknown name: an AttributeError, so hasattr() probing says False
    assert not hasattr(served_ds, "no_such_api")
    with pytest.raises(AttributeError, match="deepspeed.no_such_api is not served by ringzero"):
        served_ds.no_such_api
    with pytest.raises(ModuleNotFoundError, match="deepspeed.ops.transformer is not served") as e:
        import deepspeed.ops.transformer  # noqa: F401
    assert isinstance(e.value, finder.NotServedImportError)
    with pytest.raises(finder.NotServedAttributeError, match=r"get_accelerator\(\).create_graph is not served"):
        served_ds.accelerator.get_accelerator().create_graph()


def test_a_refusal_swallowed_or_reported_by_type_still_names_itself(served_ds, monkeypatch):
    """pytest's monkeypatch reads getattr(obj, name, default), which swallows the refusal; a refused
    constant used as an attribute name is reported by its type: both messages name the refusal."""
    layer = served_ds.DeepSpeedTransformerLayer
    with pytest.raises(AttributeError, match=r"deepspeed.DeepSpeedTransformerLayer is not served by ringzero .*DeepSpeed would"):
        monkeypatch.setattr(layer, "some_attribute", 1)
    with pytest.raises(TypeError, match="not 'deepspeed.DeepSpeedTransformerLayer is not served by ringzero'"):
        setattr(torch.nn.Linear(1, 1), layer, 1)
    Init = served_ds.runtime.zero.partition_parameters.Init
    with pytest.raises(finder.NotServedAttributeError, match="Init._partition_param_sec is not served.*hpZ"):
        Init._partition_param_sec
    assert not hasattr(Init, "no_such_name")


def test_moe_split_moves_expert_parameters_into_their_own_groups(served_ds):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    group = {"params": [w, b], "name": "parameters", "lr": 0.1}
    assert split(group) == [group] and split((group,)) == [group]      # DeepSpeed's, without expert parameters
    w.allreduce, w.group_name = False, "ep_size_2"                         # what DeepSpeed's MoE layer marks
    assert split(group) == [{"params": [b], "name": "parameters", "lr": 0.1},
                            {"params": [w], "name": "ep_size_2", "lr": 0.1, "moe": True}]


def test_installing_after_the_real_deepspeed_refuses(monkeypatch):
    if "deepspeed" not in sys.modules:   # stands for the installed package imported before the runner
        monkeypatch.setitem(sys.modules, "deepspeed", type(sys)("deepspeed"))
    with pytest.raises(RuntimeError, match="installed DeepSpeed is already imported"):
        finder.install()
    assert finder.FINDER not in sys.meta_path


def test_split_argv_hands_the_launchers_local_rank_to_the_script():
    assert split_argv(["--local_rank=1", "s.py", "--x", "2"]) == ("s.py", ["--local_rank=1", "--x", "2"])
    assert split_argv(["--local_rank", "0", "s.py"]) == ("s.py", ["--local_rank", "0"])
    assert split_argv(["s.py", "--local_rank=3"]) == ("s.py", ["--local_rank=3"])
    assert split_argv(["--local_rank=1", "-m", "a.b", "-m", "x"]) == ("-m a.b", ["--local_rank=1", "-m", "x"])
    with pytest.raises(SystemExit, match="usage"):
        split_argv(["--x"])


def test_list_prints_the_table(served_ds, capsys):
    from zero_from_scratch.as_deepspeed.__main__ import main
    main(["--list"])
    out = capsys.readouterr().out
    assert "deepspeed.initialize" in out and "served" in out and "refused" in out and "0.19.8" in out


def test_every_name_deepspeed_checkpoint_exports_is_served_or_refused(served_ds):
    """deepspeed/checkpoint/__init__.py's names (its own and constants.py's `import *`), and the methods of
    its two checkpoint classes: each is DeepSpeed's value / a ringzero object, or a refusal at first use;
    none is a bare ImportError or AttributeError."""
    probe = ("import json, deepspeed.checkpoint as c, types\n"
             "names = {n: getattr(c, n) for n in dir(c) if not n.startswith('_')}\n"
             "print(json.dumps({'values': {n: v for n, v in names.items() if isinstance(v, (str, int, list))},\n"
             "  'others': [n for n, v in names.items() if not isinstance(v, (str, int, list, types.ModuleType))],\n"
             "  'methods': {k: [n for n in vars(getattr(c, k)) if not n.startswith('__')]\n"
             "              for k in ('ZeROCheckpoint', 'DeepSpeedCheckpoint')}}))")
    env = {k: v for k, v in os.environ.items() if k not in ("RINGZERO_DEEPSPEED", "RINGZERO_DEEPSPEED_DEFER")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        pytest.skip(f"the installed DeepSpeed's names: {out.stderr.strip().splitlines()[-1:]}")
    ds = json.loads(out.stdout.strip().splitlines()[-1])
    import deepspeed.checkpoint as ours
    refused = served = 0
    for name in [*ds["values"], *ds["others"]]:
        got = getattr(ours, name)     # what `from deepspeed.checkpoint import name` reads
        if isinstance(got, finder._Refused):
            with pytest.raises(finder.NotServedError, match=f"deepspeed[.]checkpoint[.]{name} is not served"):
                got()
            refused += 1
        else:
            assert name not in ds["values"] or got == ds["values"][name], name
            served += 1
    assert served >= 50 and refused >= 50, (served, refused)
    for cls, methods in ds["methods"].items():
        obj = object.__new__(getattr(ours, cls))
        for m in methods:
            try:
                getattr(obj, m)
            except finder.NotServedAttributeError as e:
                assert str(e).startswith(f"deepspeed.checkpoint.{cls}.{m} is not served") and "\n" not in str(e)
