"""The `deepspeed` runner: every served name, the not-served errors, and a script run unchanged on 2 ranks.

    python -m pytest -x -q tests/test_as_deepspeed.py

The finder is installed in this process only inside the `served` fixture (the real DeepSpeed's
modules, if an earlier test imported them, are set aside and put back). The run under torchrun
is compared with the same training written against zero_from_scratch.initialize directly (an
independent process group from spawn): the runner must add nothing to the numbers, so the
losses are equal bit for bit. clients/README.md has the comparisons with the real DeepSpeed.
"""
import argparse
import importlib
import logging
import os
import random
import sys

import numpy
import pytest
import torch
import torch.distributed as dist

from primitives.launch import free_port
from tests.conftest import run_cmd
from zero_from_scratch.as_deepspeed import finder, served
from zero_from_scratch.as_deepspeed.__main__ import split_argv

HERE = os.path.dirname(os.path.abspath(finder.__file__))

TINY = '''
import argparse
import sys

import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=4)
p = deepspeed.add_config_arguments(p)
args = p.parse_args()
deepspeed.init_distributed()
deepspeed.runtime.utils.set_random_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
engine, opt, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
dev = get_accelerator().device_name(dist.get_local_rank())
for step in range(args.steps):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    loss = ((engine(x.to(dev)) - y.to(dev)) ** 2).mean()
    engine.backward(loss)
    engine.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        print("LOSS", step, repr(t.item()))
ours = lambda m: type(m).__name__ == "ServedModule"
if dist.get_rank() == 0:
    print("FILE", deepspeed.__file__, "VERSION", deepspeed.__version__, "ARGV", sys.argv[1:3])
    print("REAL", sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "deepspeed" and not ours(m)))
'''
CONFIG = ('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, '
          '"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": true}}}')


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
    assert not isinstance(torch.nn.Linear(1, 1), served_ds.moe.layer.MoE)
    with pytest.raises(finder.NotServedAttributeError, match="nearest ringzero way"):
        served_ds.moe.layer.MoE.some_attribute
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
    moe = served_ds.moe.layer.MoE
    with pytest.raises(AttributeError, match=r"deepspeed.moe.layer.MoE is not served by ringzero .*DeepSpeed would"):
        monkeypatch.setattr(moe, "some_attribute", 1)
    with pytest.raises(TypeError, match="not 'deepspeed.moe.layer.MoE is not served by ringzero'"):
        setattr(torch.nn.Linear(1, 1), moe, 1)
    Init = served_ds.runtime.zero.partition_parameters.Init
    with pytest.raises(finder.NotServedAttributeError, match="Init._partition_param_sec is not served.*hpZ"):
        Init._partition_param_sec
    assert not hasattr(Init, "no_such_name")


def test_moe_split_serves_dense_groups_and_refuses_experts(served_ds):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    group = {"params": [w, b], "name": "parameters"}
    assert split(group) == [group] and split((group,)) == [group]      # DeepSpeed's, without expert parameters
    w.allreduce = False                                                   # what DeepSpeed's MoE layer marks
    with pytest.raises(finder.NotServedError, match="1 expert parameters.*ringzero has no MoE"):
        split(group)


def test_installing_after_the_real_deepspeed_refuses(monkeypatch):
    if "deepspeed" not in sys.modules:   # stands for the installed package imported before the runner
        monkeypatch.setitem(sys.modules, "deepspeed", type(sys)("deepspeed"))
    with pytest.raises(RuntimeError, match="installed DeepSpeed is already imported"):
        finder.install()
    assert finder.FINDER not in sys.meta_path


def test_add_config_arguments_and_config_from_args(served_ds):
    p = served_ds.add_config_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (a.deepspeed, a.deepspeed_config, a.deepscale, a.deepscale_config) == (True, "ds.json", False, None)
    from zero_from_scratch.as_deepspeed.top import _config_from
    assert _config_from(a, None, None) == "ds.json"
    assert _config_from(argparse.Namespace(), None, {"k": 1}) == {"k": 1}           # config_params (accelerate)
    old = argparse.Namespace(deepscale_config="old.json", deepspeed_config=None)
    assert _config_from(old, None, None) == "old.json" and old.deepscale_config is None
    with pytest.raises(AssertionError, match="given deepspeed configs in the deepspeed arguments"):
        _config_from(a, {"k": 1}, None)
    with pytest.raises(AssertionError, match="requires --deepspeed_config"):
        _config_from(None, None, None)


def test_utils_follow_deepspeed(served_ds):
    from deepspeed.runtime.utils import set_random_seed
    set_random_seed(2**40 + 3)
    got = (random.random(), numpy.random.rand(), torch.rand(1).item())
    random.seed(2**40 + 3)
    numpy.random.seed((2**40 + 3) % 2**32)
    torch.manual_seed(2**40 + 3)
    assert got == (random.random(), numpy.random.rand(), torch.rand(1).item())
    log = served_ds.utils.logger
    assert log is logging.getLogger("DeepSpeed") and log.level == logging.WARNING and not log.propagate
    seen = []
    h = logging.Handler()
    h.emit = lambda rec: seen.append(rec.getMessage())
    log.addHandler(h)
    served_ds.utils.log_dist("hello", ranks=[0], level=logging.WARNING)   # no process group: every rank logs
    log.removeHandler(h)
    assert seen == ["[Rank -1] hello"]
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    t = torch.ones(2)
    out = clone_tensors_for_torch_save({"a": [t, (t, 3)]})
    assert out["a"][0] is not t and torch.equal(out["a"][1][0], t) and out["a"][1][1] == 3


def test_accelerator_is_deepspeeds_cpu_accelerator(served_ds, monkeypatch):
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    assert acc is served_ds.get_accelerator()
    monkeypatch.setenv("LOCAL_RANK", "1")
    if acc._name == "cpu":
        assert (acc.device_name(1), acc.device_name(), acc.current_device_name()) == ("cpu", "cpu", "cpu")
        assert acc.current_device() == "1"        # DeepSpeed's cpu accelerator returns the env string
        assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported() and acc.is_available()
        assert acc.device(0) is None and acc.memory_allocated() > 0 and acc.total_memory() > acc.memory_allocated()
    acc.manual_seed_all(5)
    a = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(a, torch.rand(1))
    assert acc.pin_memory(torch.ones(1)).sum() == 1 and acc.lazy_call(lambda: 7) == 7
    assert not hasattr(acc, "create_graph")


def test_split_argv_hands_the_launchers_local_rank_to_the_script():
    assert split_argv(["--local_rank=1", "s.py", "--x", "2"]) == ("s.py", ["--local_rank=1", "--x", "2"])
    assert split_argv(["--local_rank", "0", "s.py"]) == ("s.py", ["--local_rank", "0"])
    assert split_argv(["s.py", "--local_rank=3"]) == ("s.py", ["--local_rank=3"])
    with pytest.raises(SystemExit, match="usage"):
        split_argv(["--x"])


def _reference_and_comm(rank, world):
    """The TINY script's training written against zero_from_scratch.initialize, and deepspeed.comm vs torch."""
    finder.install()
    import deepspeed.comm as ds_dist
    x = torch.arange(6, dtype=torch.float32) + rank
    y = x.clone()
    ds_dist.all_reduce(x)
    dist.all_reduce(y)
    out, want = torch.empty(12), torch.empty(12)
    ds_dist.all_gather_into_tensor(out, x)
    dist.all_gather_into_tensor(want, x)
    rs, rs_want = torch.empty(3), torch.empty(3)
    ds_dist.reduce_scatter_tensor(rs, x * (rank + 1))
    dist.reduce_scatter_tensor(rs_want, x * (rank + 1))
    b = torch.full((2,), float(rank))
    ds_dist.broadcast(b, 1)
    ds_dist.barrier()
    comm = (torch.equal(x, y), torch.equal(out, want), torch.equal(rs, rs_want), b.tolist(),
            ds_dist.get_rank(), ds_dist.get_world_size(), ds_dist.is_initialized())
    import deepspeed
    try:
        deepspeed.initialize(model=torch.nn.Linear(1, 1), config={}, mesh_param=(2, 1))
    except finder.NotServedError as e:
        comm += (str(e),)
    finder.uninstall()
    import json
    import zero_from_scratch
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(),
                                              config=json.loads(CONFIG))
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        xb, yb = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = ((engine(xb) - yb) ** 2).mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
    return comm, losses


def test_unchanged_script_under_torchrun_equals_zero_from_scratch_directly(tmp_path, spawn):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "ds.json").write_text(CONFIG)
    r = run_cmd(f"torchrun --nproc_per_node 2 --master_port {free_port()} -m zero_from_scratch.as_deepspeed "
                f"{tmp_path}/tiny.py --deepspeed_config {tmp_path}/ds.json", timeout=240)
    assert "ringzero serves deepspeed (DeepSpeed 0.19.8's API)" in " ".join(r.stderr.split())
    lines = [ln.split() for ln in r.stdout.splitlines()]
    losses = [float(ln[2]) for ln in lines if ln[:1] == ["LOSS"]]
    file_line = next(ln for ln in lines if ln[:1] == ["FILE"])
    assert file_line[1] == os.path.join(HERE, "top.py") and file_line[3] == "0.19.8"
    assert next(ln for ln in r.stdout.splitlines() if ln.startswith("REAL")) == "REAL []"   # DeepSpeed never imported
    (comm0, ref), (comm1, _) = spawn(_reference_and_comm, 2)
    assert comm0[:7] == (True, True, True, [1.0, 1.0], 0, 2, True) and comm1[4] == 1
    assert comm0[7].startswith("deepspeed.initialize(mesh_param=...) is not served by ringzero")
    assert len(losses) == 4 and losses == ref


@pytest.mark.parametrize("patched, diff", [("clients/cifar10/cifar10_deepspeed.py", "clients/cifar10/cifar10.diff"),
                                           ("clients/hello_deepspeed/train_bert_ds.py",
                                            "clients/hello_deepspeed/train_bert_ds.diff")])
def test_client_diffs_are_the_whole_change_from_upstream(patched, diff):
    """The .diff kept beside each client lists every line changed from upstream.py (the file at
    DeepSpeedExamples' commit named in clients/README.md): the readable record of the patch."""
    import difflib

    from tests import upstream
    up_path = os.path.join(os.path.dirname(patched), "upstream.py")
    if not (upstream.present(patched) and upstream.present(up_path)):
        pytest.skip(upstream.skip_reason(up_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    read = lambda p: open(os.path.join(root, p), newline="").read().splitlines()   # noqa: E731
    up = read(os.path.join(os.path.dirname(patched), "upstream.py"))
    changed = [ln for ln in difflib.unified_diff(up, read(patched), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    kept = [ln for ln in read(diff) if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert sorted(changed) == sorted(kept) and changed   # the same lines (diff tools align blank lines differently)


def _zero_to_fp32(rank, world, ckpt):
    """A ZeRO-2 checkpoint of 2 ranks read back through deepspeed.utils.zero_to_fp32's three functions."""
    import zero_from_scratch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(),
                                              config={"train_micro_batch_size_per_gpu": 2, "zero_optimization":
                                                      {"stage": 2}, "optimizer": {"type": "AdamW",
                                                                                  "params": {"lr": 0.1}}})
    for step in range(2):
        engine.backward(engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(step + 10 * rank))).sum())
        engine.step()
    engine.save_checkpoint(ckpt)
    dist.barrier()
    if rank != 0:
        return None
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}   # stage 2: full parameters here
    finder.install()
    try:
        from deepspeed.utils import zero_to_fp32 as z
        sd = z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, f"{ckpt}/out", max_shard_size=300)
        shards = sorted(f for f in os.listdir(f"{ckpt}/out") if f.endswith(".bin"))
        merged = {k: v for f in shards for k, v in torch.load(f"{ckpt}/out/{f}").items()}
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        loaded = z.load_state_dict_from_zero_checkpoint(fresh, ckpt).state_dict()
        lazy = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)   # ordinary tensors, same values
        index = os.path.isfile(f"{ckpt}/out/pytorch_model.bin.index.json")
    finally:
        finder.uninstall()
    same = lambda a: sorted(a) == sorted(want) and all(torch.equal(a[k], want[k]) for k in want)   # noqa: E731
    return same(sd), same(merged), same(loaded), len(shards), index, same(lazy)


def test_zero_to_fp32_functions_read_a_zero2_checkpoint(tmp_path, spawn):
    got = spawn(_zero_to_fp32, 2, args=(str(tmp_path / "ck"),))[0]
    assert got[:3] == (True, True, True) and got[3] > 1 and got[4] and got[5]   # sharded at 300 B, with its index


def test_list_prints_the_table(served_ds, capsys):
    from zero_from_scratch.as_deepspeed.__main__ import main
    main(["--list"])
    out = capsys.readouterr().out
    assert "deepspeed.initialize" in out and "served" in out and "refused" in out and "0.19.8" in out


def test_quirks_the_runner_applies_as_deepspeed_does(tmp_path, caplog):
    """quirks.py: the deprecated cpu_offload keys map as DeepSpeed 0.19.8's config does (with its assertion
    when both spellings are given), fp32 pipelines clip by stage 0 unless told, and config files are hjson."""
    from zero_from_scratch.as_deepspeed import quirks
    cfg = {"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}
    out = quirks.deprecated_offload_keys(cfg)
    assert out["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert cfg["zero_optimization"]["cpu_offload"] is True           # the caller's dict is left alone
    assert quirks.deprecated_offload_keys({"zero_optimization": {"stage": 3, "cpu_offload_param": False}}) == \
        {"zero_optimization": {"stage": 3}}
    with pytest.raises(AssertionError, match="Cannot provide deprecated parameter 'cpu_offload'"):
        quirks.deprecated_offload_keys({"zero_optimization": {"cpu_offload": False, "offload_optimizer": {}}})
    assert quirks.pipeline_defaults({"train_batch_size": 4})["pipeline"] == {"clip_norm": "stage0", "use_reentrant": True}
    for kept in ({"bf16": {"enabled": True}}, {"pipeline": {"clip_norm": "global"}}):
        assert quirks.pipeline_defaults(kept) == {**kept, "pipeline": {**kept.get("pipeline", {}), "use_reentrant": True}}
    p = tmp_path / "ds.json"
    p.write_text("{\n  # a comment\n  train_batch_size: 8,\n}\n")
    assert quirks.read_config(str(p)) == {"train_batch_size": 8}
    p.write_text('{"a": 1, "a": 2}')
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['a'\]"):
        quirks.read_config(str(p))


def test_config_model_base_behaves_as_deepspeeds():
    """DeepSpeedConfigModel as served: the same section class on DeepSpeed's base and on ours accepts,
    moves deprecated values, resolves aliases and refuses the same inputs."""
    from typing import List, Optional
    from pydantic import Field, ValidationError
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel as Theirs
    from zero_from_scratch.as_deepspeed.config_model import DeepSpeedConfigModel as Ours

    def section(base):
        class Conf(base):
            a: int = 0
            old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                                "new_param_fn": lambda x: [x]})
            new: Optional[List[str]] = None
            c: int = Field(0, alias="c_alias")
        return Conf

    def outcome(cls, kw):
        try:
            return cls(**kw).model_dump()
        except (ValidationError, AssertionError) as e:
            return type(e).__name__
    cases = [{"a": 42}, {"old": "DS"}, {"c": 10}, {"c_alias": 10}, {"a": "DS"}, {"new": "DS"}, {"typo": 0},
             {"new": ["DS"], "old": "DS"}, {"a": "auto"}]
    assert [outcome(section(Ours), k) for k in cases] == [outcome(section(Theirs), k) for k in cases]


def test_config_objects_follow_deepspeeds_schema():
    """DeepSpeedZeroConfig, its offload sections and the bf16 section as served declare DeepSpeed's fields
    (names, defaults, aliases), and the same inputs give the same values (deprecations, aliases, the
    stage-dependent overlap_comm) or the same refusals; DeepSpeedConfig's batch triple and allreduce checks."""
    from pydantic import ValidationError
    from deepspeed.runtime.config import DeepSpeedConfig as TheirConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    from zero_from_scratch.as_deepspeed import config_objects as ours
    for theirs in (DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig, DeepSpeedZeroOffloadOptimizerConfig,
                   DeepSpeedBF16Config):
        mine = getattr(ours, theirs.__name__)
        fields = {k: (f.alias, None if f.default_factory else f.default) for k, f in theirs.model_fields.items()}
        assert {k: (f.alias, None if f.default_factory else f.default) for k, f in mine.model_fields.items()} == fields

    def outcome(cls, kw):
        try:
            return cls(**kw).model_dump(mode="json")
        except (ValidationError, ValueError, AssertionError) as e:
            return type(e).__name__
    cases = [{}, {"stage": 3}, {"cpu_offload": True}, {"cpu_offload_param": True}, {"stage3_prefetch_bucket_size": 7},
             {"stage3_gather_fp16_weights_on_model_save": True}, {"offload_optimizer": {"pipeline_read": True}},
             {"leaf_module": {"names": "a"}}, {"stage": 5}, {"typo": 1}, {"reduce_bucket_size": 0},
             {"compute_grad_norm": False, "stage": 3}, {"offload_optimizer": {"ratio": 0.5}, "stage": 2}]
    assert [outcome(ours.DeepSpeedZeroConfig, k) for k in cases] == [outcome(DeepSpeedZeroConfig, k) for k in cases]
    for d in ({"train_batch_size": 8}, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
              {"train_batch_size": 1, "gradient_allreduce_op": "SUM"}):
        a, b = ({k: getattr(c, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps", "gradient_allreduce_op")}
                for c in (ours.DeepSpeedConfig(d), TheirConfig(d)))
        assert a == b
    for d in ({"train_batch_size": 1, "gradient_allreduce_op": "max"},
              {"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}):
        with pytest.raises(ValueError) as e1:
            ours.DeepSpeedConfig(d)
        with pytest.raises(ValueError) as e2:
            TheirConfig(d)
        assert str(e1.value).split(".")[0] == str(e2.value).split(".")[0]
