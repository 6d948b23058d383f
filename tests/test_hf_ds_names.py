"""DeepSpeed's own names under the runner, which transformers' Trainer tests look for: the "DeepSpeed info"
line deepspeed.initialize logs, and a bf16 engine's optimizer-state file names.

    python -m pytest -q tests/test_hf_ds_names.py              (the line against DeepSpeed's; ringzero's readers)
    python -m pytest -q -m slow tests/test_hf_ds_names.py      (DeepSpeed's engine resumes from ringzero's bf16 folder)

transformers' test_trainer_distributed_deepspeed.py asserts "DeepSpeed info" in what DeepSpeed's logger
printed during `trainer.train()` (the Trainer sets that logger to its own level, INFO in the tests) and
that a bf16 checkpoint holds `bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt` (DeepSpeed's engine
prefixes "bf16_" to every ZeRO optimizer-state file when bf16 is on: runtime/engine.py
_get_zero_ckpt_prefix). Reference: the installed DeepSpeed 0.19.8 in the same processes.
"""
import glob
import io
import logging
import os

import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from tests.test_zero_surface_ds import _steps   # the same loss loop, bf16 input from the model's dtype

pytest.importorskip("deepspeed")

MB = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _cfg(stage, bf16=True):
    return {"train_micro_batch_size_per_gpu": MB, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}}


def _info_lines(rank, world):
    """The "DeepSpeed info" records DeepSpeed's and the runner's initialize log on DeepSpeed's logger at INFO."""
    from parity.zero.sides import prepare_deepspeed
    from zero_from_scratch.as_deepspeed import top      # imports the served logger (WARNING) before we lower it
    ds = prepare_deepspeed()
    log = logging.getLogger("DeepSpeed")
    out = {}
    for side, init in (("deepspeed", ds.initialize), ("ringzero", top.initialize)):
        log.setLevel(logging.INFO)     # as transformers' deepspeed_init: ds_logger.setLevel(<its log level>)
        buf = io.StringIO()
        h = logging.StreamHandler(buf)
        log.addHandler(h)
        for _ in range(2):             # the first before, the second after initialize ran init_distributed
            m = _model()
            init(model=m, model_parameters=m.parameters(), config=_cfg(0, bf16=False))
        log.removeHandler(h)
        out[side] = [ln for ln in buf.getvalue().splitlines() if "DeepSpeed info" in ln]
    return out


def test_initialize_logs_deepspeeds_info_line(spawn):
    """torch.distributed is up (spawn), but DeepSpeed's rank test asks deepspeed.comm, which knows of it only
    after deepspeed.init_distributed: the first initialize logs "[Rank -1]" on every rank, later ones rank 0."""
    line = "DeepSpeed info: version=0.19.8, git-hash=unknown, git-branch=unknown"
    for rank, out in enumerate(spawn(_info_lines, 2, timeout=300.0)):
        assert out["ringzero"] == out["deepspeed"], out
        assert out["deepspeed"] == [f"[Rank -1] {line}"] + ([f"[Rank 0] {line}"] if rank == 0 else []), out


def _rename_to_unprefixed(d):
    """A folder whose optimizer files lack the bf16_ prefix (zero_pp_rank_*): one a fp32-named writer made."""
    for f in glob.glob(os.path.join(d, "bf16_zero_pp_rank_*_optim_states.pt")):
        os.rename(f, os.path.join(os.path.dirname(f), os.path.basename(f)[len("bf16_"):]))


def _ringzero_reads_both_names(rank, world, d, stage):
    """Save at bf16, then load three folders into fresh engines: as written (ringzero's manifest), with the
    optimizer files renamed without the bf16_ prefix, and that one without ringzero's
    manifest (read as a DeepSpeed folder: checkpoint_ds.read_full). Each loaded engine takes the same 2 steps."""
    e, *_ = zero_from_scratch.initialize(model=_model(), config=_cfg(stage))
    _steps(e, rank, range(2))
    e.save_checkpoint(d, tag="t")
    names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(d, "t", "*_optim_states.pt")))
    want = _steps(e, rank, range(2, 4))
    got = {}
    for form in ("written", "unprefixed", "deepspeed-layout"):
        if rank == 0 and form == "unprefixed":
            _rename_to_unprefixed(os.path.join(d, "t"))
        if rank == 0 and form == "deepspeed-layout":
            for f in glob.glob(os.path.join(d, "t", "*manifest.json")):
                os.remove(f)
        torch.distributed.barrier()
        m = _model()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(-3.0)             # different weights: the load must replace them
        e2, *_ = zero_from_scratch.initialize(model=m, config=_cfg(stage))
        e2.load_checkpoint(d, tag="t")
        got[form] = _steps(e2, rank, range(2, 4))
        torch.distributed.barrier()
    return names, want, got


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_optimizer_files_are_named_as_deepspeeds_and_unprefixed_folders_load(spawn, tmp_path, stage):
    names, want, got = spawn(_ringzero_reads_both_names, 2, args=(str(tmp_path), stage), timeout=300.0)[0]
    assert names == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert got["written"] == want and got["unprefixed"] == want      # ringzero's own manifest: bit for bit
    # DeepSpeed's layout holds the fp32 master and Adam states: the bf16 weights are rounded from the same
    # master, so the losses equal the manifest's up to the loss's bf16 rounding (2^-8 relative)
    for a, b in zip(want, got["deepspeed-layout"]):
        assert abs(a - b) <= 4e-3 * abs(a), (want, got)


def _deepspeed_resumes_from_ringzero_bf16(rank, world, d, stage):
    """ringzero trains 2 steps at bf16, saves, trains 2 more; DeepSpeed's bf16 engine loads the folder
    (it opens only bf16_zero_pp_rank_* optimizer files) and trains the same 2."""
    import warnings
    warnings.filterwarnings("ignore")
    from parity.zero.sides import prepare_deepspeed
    e, *_ = zero_from_scratch.initialize(model=_model(), config=_cfg(stage))
    _steps(e, rank, range(2))
    e.save_checkpoint(d)
    want = _steps(e, rank, range(2, 4))
    m = _model()
    ds, *_ = prepare_deepspeed().initialize(model=m, model_parameters=m.parameters(), config=_cfg(stage))
    ds.load_checkpoint(d)
    return want, _steps(ds, rank, range(2, 4)), ds.global_steps


@pytest.mark.slow
def test_deepspeed_resumes_from_ringzero_bf16_folder(spawn, tmp_path):
    """ZeRO-2 (ZeRO-3 at bf16: tests/test_zero_surface_ds.py::test_deepspeed_resumes_from_our_checkpoint)."""
    want, got, steps = spawn(_deepspeed_resumes_from_ringzero_bf16, 2, args=(str(tmp_path), 2), timeout=600.0)[0]
    assert steps == 4
    for a, b in zip(want, got):      # the same fp32 master and Adam states; bf16 rounding of the loss (2^-8)
        assert abs(a - b) <= 4e-3 * abs(a), (want, got)


def _save_bf16(rank, world, d, stage):
    e, *_ = zero_from_scratch.initialize(model=_model(), config=_cfg(stage))
    _steps(e, rank, range(2))
    e.save_checkpoint(d)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_zero_to_fp32_reads_ringzero_bf16_folder(spawn, tmp_path, stage):
    spawn(_save_bf16, 2, args=(str(tmp_path), stage), timeout=300.0)
    from parity.zero.sides import prepare_deepspeed
    from zero_from_scratch.engine.checkpoint_read import consolidate
    prepare_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    theirs, ours = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path)), consolidate(str(tmp_path))
    assert sorted(theirs) == sorted(ours)
    for k in ours:
        assert torch.equal(theirs[k].float(), ours[k].float()), k
