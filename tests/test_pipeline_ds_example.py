"""DeepSpeed's pipeline example (DeepSpeedExamples training/pipeline_parallelism/train.py, AlexNet, pp=2)
unchanged but for offline data, torchvision's stand-ins and sizes: real DeepSpeed vs ringzero's runner.

    python -m pytest -q tests/test_pipeline_ds_example.py                  (the patch record, < 1 s)
    python -m pytest -q -m slow tests/test_pipeline_ds_example.py          (4 two-rank runs, ~6-12 min on 2 cores)
    python -m clients.compare --case pipeline-fp32-pp2 --case pipeline-fp32-pp2-clip-global

The losses are DeepSpeed's csv_monitor's Train/Samples/train_loss, one per step, written by both
sides. Under the runner ringzero clips as DeepSpeed 0.19.8's fp32 pipeline by default (as
"pipeline": {"clip_norm": "stage0"} asks: as_deepspeed/quirks.py), as DeepSpeed does (deepspeed/runtime/utils.py::clip_grad_norm_: the norm of model-parallel rank 0 = stage 0
only, in fp32) and every step agrees within 1e-5 relative (fp32; measured: the training is the same to the
bit, the logged loss differs by < 1 fp32 ulp because DeepSpeed averages the micro-batch losses in
fp32). ds_config_small.json asks for torch_adam: DeepSpeed's CPU FusedAdam is a JIT build (minutes)
and rounds differently (clients.compare's "-fused-adam" case: ~1e-6). With "clip_norm": "global" (ringzero's own
default) the steps before clipping starts agree and the later ones do not: the clipping is the cause of the difference.
"""
import difflib
import json
import os
import tempfile

import pytest

from clients.compare import ALL_CASES, client_config, csv_losses, run_side, tolerance
from primitives.launch import free_port
from tests import upstream
from tests.conftest import ROOT, run_cmd

HERE = os.path.join(ROOT, "clients", "pipeline")
pytestmark = upstream.skip_unless_present("clients/pipeline/train.py", "clients/pipeline/upstream.py",
                                         "clients/pipeline/ds_config.json")
STAGE0, DEFAULT, GLOBAL = "pipeline-fp32-pp2-clip-stage0", "pipeline-fp32-pp2", "pipeline-fp32-pp2-clip-global"


def _lines(name):
    with open(os.path.join(HERE, name), newline="") as f:
        return f.read().splitlines()


def test_the_diff_is_the_whole_change_from_upstream():
    """train.diff lists every line train.py changes from upstream.py (DeepSpeedExamples' file at the
    commit clients/README.md names), and its header says why torchvision is replaced."""
    changed = [ln for ln in difflib.unified_diff(_lines("upstream.py"), _lines("train.py"), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    kept = [ln for ln in _lines("train.diff") if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed and sorted(changed) == sorted(kept)
    head = "\n".join(_lines("train.diff")[:15])
    assert "torchvision::nms" in head and "alexnet.py" in head
    assert not any("torchvision" in ln for ln in _lines("train.py") if not ln.lstrip().startswith("#"))


def test_the_small_config_changes_only_sizes_the_print_interval_and_torch_adam():
    up, small = (json.load(open(os.path.join(HERE, n))) for n in ("ds_config.json", "ds_config_small.json"))
    assert {k for k in up if up[k] != small.get(k)} == {"train_batch_size", "train_micro_batch_size_per_gpu",
                                                        "steps_per_print", "optimizer"} and set(up) == set(small)
    assert small["optimizer"]["params"] == {**up["optimizer"]["params"], "torch_adam": True}


def _relative(a, b):
    return [abs(x - y) / abs(x) for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def deepspeed_losses():
    """The real DeepSpeed's per-step losses (its run ignores pipeline.clip_norm: one run serves every case)."""
    return run_side(STAGE0, "deepspeed")


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.timeout(1800)
def test_with_clip_norm_stage0_every_step_equals_deepspeed(deepspeed_losses):
    ours = run_side(STAGE0, "ringzero")
    assert len(ours) == len(deepspeed_losses) == 4
    assert all(abs(a - b) <= tolerance("fp32", a) for a, b in zip(deepspeed_losses, ours)), \
        (deepspeed_losses, ours, _relative(deepspeed_losses, ours))


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.timeout(1800)
def test_its_own_config_under_the_runner_equals_deepspeed(deepspeed_losses):
    """The example's config unchanged: the runner's default is DeepSpeed's fp32 pipeline clipping."""
    ours = run_side(DEFAULT, "ringzero")
    assert len(ours) == 4 and all(abs(a - b) <= tolerance("fp32", a) for a, b in zip(deepspeed_losses, ours)), \
        (deepspeed_losses, ours, _relative(deepspeed_losses, ours))


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.timeout(1800)
def test_global_clipping_differs_once_clipping_starts(deepspeed_losses):
    """Step 1 is before any update and step 2's update is unclipped (the global norm is under 1.0):
    equal; from the clipped second update on, stage 0's norm alone vs every stage's differ by far more."""
    ours = run_side(GLOBAL, "ringzero")
    rel = _relative(deepspeed_losses, ours)
    assert max(rel[:2]) <= 1e-5 and min(rel[2:]) > 1e-3, (deepspeed_losses, ours, rel)


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.timeout(1800)
def test_under_the_deepspeed_launcher(deepspeed_losses):
    """`deepspeed --num_gpus 2 --module zero_from_scratch.as_deepspeed train.py ...` (the launcher passes
    --local_rank=N first; the script seeds itself) gives DeepSpeed's losses too."""
    case = ALL_CASES[STAGE0]
    with tempfile.TemporaryDirectory(prefix="client-launcher-") as tmp:
        args = case.args.format(config=client_config(case, tmp))
        run_cmd(f"deepspeed --num_gpus 2 --master_port {free_port()} --module zero_from_scratch.as_deepspeed "
                f"{case.script} {args}", timeout=900, env={"OMP_NUM_THREADS": "1"})
        ours = csv_losses(tmp)
    assert len(ours) == 4 and all(abs(a - b) <= tolerance("fp32", a) for a, b in zip(deepspeed_losses, ours)), \
        (deepspeed_losses, ours)
