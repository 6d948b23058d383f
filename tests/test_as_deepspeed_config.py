"""The `deepspeed` runner's helpers as DeepSpeed's: config arguments, utils, the accelerator, quirks, config models.

    python -m pytest -x -q tests/test_as_deepspeed_config.py

Each compares the served object with DeepSpeed 0.19.8's behaviour: the installed package where it can be
imported beside ours (config models), else DeepSpeed's documented values.
"""
import argparse
import logging
import random

import numpy
import pytest
import torch

from tests.test_as_deepspeed_names import served_ds  # noqa: F401  (the fixture)


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
    # the "DeepSpeed" logger is process-wide: a test run earlier in this worker may have quieted it
    # (real_deepspeed.prepare_deepspeed), so the level checked is the one the served module's import sets
    from zero_from_scratch.as_deepspeed import utils as served_utils
    assert served_utils._make_logger() is served_ds.utils.logger
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
