"""offload_optimizer to files (zero_from_scratch/engine/offload.py).

    python -m pytest -q tests/test_recipes_offload.py

* nvme vs no offload, same data, two ranks: bit-identical losses, gradient norms and final
  parameters at stages 1-3, fp32 and bf16 (offload moves bytes, not maths), with sub_group_size
  far below a shard so the step really streams chunk after chunk; no optimizer state in RAM
  (ZeRO-2 bf16 and ZeRO-3 fp32 by default, the other four `slow`).
* an unwritable nvme_path: a clear error on every rank at start-up.
* a write that fails mid-step (ENOSPC injected on rank 1): every rank raises OffloadError, and the
  checkpoint saved before it still loads and equals the run that never failed.
* "none" = no offload; bad keys refused. ("cpu": tests/test_recipes_offload_cpu.py.)
"""
import errno
import os

import pytest
import torch

import zero_from_scratch  # noqa: E402
from zero_from_scratch.engine import offload  # noqa: E402
from zero_from_scratch.engine.models import tiny_distilbert  # noqa: E402


def _cfg(stage, bf16, off, path=None, sub=50):
    z = {"stage": stage, "sub_group_size": sub}
    if off:
        z["offload_optimizer"] = {"device": off, **({"nvme_path": path} if path else {})}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.5, "bf16": {"enabled": bf16}, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


def _data(g):
    return {"input_ids": torch.randint(1, 101, (2, 10), generator=g), "labels": torch.randint(0, 2, (2,), generator=g)}


def _train(rank, cfg, steps=3, fail_at=None, ckpt=None):
    torch.manual_seed(0)
    model = tiny_distilbert()
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(rank)
    rec = []
    for step in range(steps):
        if step == fail_at and rank == 1:
            def full(write, fd, t, off):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            offload.file_io = full
        for _ in range(2):
            loss = engine(**_data(g)).loss
            engine.backward(loss)
            engine.step()
            rec.append(loss.item())
        rec.append(engine.get_global_grad_norm())
        if ckpt and step == 0:
            engine.save_checkpoint(ckpt, tag="s1")
    with engine.gathered_parameters(model.parameters()):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    ram = sum(s["exp_avg"].numel() for s in engine.optimizer.state)
    return rec, params, ram


def _compare(rank, world, path, cases):
    out = {}
    for stage, bf16 in cases:
        if True:
            p = os.path.join(path, f"s{stage}{bf16}")
            out[stage, bf16] = (_train(rank, _cfg(stage, bf16, None)), _train(rank, _cfg(stage, bf16, "nvme", p)))
    return out


ALL = [(s, b) for s in (1, 2, 3) for b in (False, True)]


@pytest.mark.parametrize("cases", [pytest.param([(2, True), (3, False)], id="zero2-bf16+zero3-fp32"),
                                   pytest.param([c for c in ALL if c not in ((2, True), (3, False))], id="rest",
                                                marks=pytest.mark.slow)])
def test_nvme_offload_is_bit_identical_to_no_offload(spawn, tmp_path, cases):
    res = spawn(_compare, 2, args=(str(tmp_path), cases), timeout=600.0)
    for r, runs in enumerate(res):
        for (stage, bf16), (plain, nvme) in runs.items():
            what = f"rank {r} ZeRO-{stage} {'bf16' if bf16 else 'fp32'}"
            assert nvme[0] == plain[0], f"{what}: losses/norms {nvme[0]} vs {plain[0]}"
            assert all(torch.equal(nvme[1][n], plain[1][n]) for n in plain[1]), f"{what}: parameters"
            assert nvme[2] == 0 and plain[2] > 0, f"{what}: optimizer states still in RAM"
    d = tmp_path / "s2True" / "zero_rank001"
    if (2, True) in cases:
        assert sorted(os.listdir(d)) == ["group0.exp_avg", "group0.exp_avg_sq", "group0.master"]


def _unwritable(rank, world, path):
    zero_from_scratch.initialize(model=tiny_distilbert(), config=_cfg(2, False, "nvme", path))


def test_unwritable_nvme_path_fails_on_every_rank(spawn, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    res = spawn(_unwritable, 2, args=(str(blocker / "x"),), allow_fail=True)
    for r, (status, value) in enumerate(res):
        assert status == "error" and f"rank {r}: offload_optimizer nvme_path" in value and "rank(s) [0, 1]" in value, value


def _fails_mid_run(rank, world, path, ckpt):
    try:
        _train(rank, _cfg(2, True, "nvme", path), steps=3, fail_at=1, ckpt=ckpt)
    except offload.OffloadError as e:
        err = str(e)
    else:
        err = None
    torch.manual_seed(0)
    model = tiny_distilbert()   # a fresh engine resumes from the checkpoint written before the failure
    engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(2, True, None))
    engine.load_checkpoint(ckpt, tag="s1")
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return err, params


def _one_step(rank, world, path):
    rec, params, _ = _train(rank, _cfg(2, True, "nvme", path), steps=1)
    return params


def test_out_of_space_mid_step_fails_everywhere_and_keeps_the_checkpoint(spawn, tmp_path):
    res = spawn(_fails_mid_run, 2, args=(str(tmp_path / "nvme"), str(tmp_path / "ckpt")))
    ref = spawn(_one_step, 2, args=(str(tmp_path / "nvme2"),))
    for r, (err, params) in enumerate(res):
        assert err and f"rank {r}: the optimizer step failed" in err and "rank(s) [1]" in err, err
        assert "No space left on device" in err or r == 0
        assert all(torch.equal(params[n], ref[r][n]) for n in params), f"rank {r}: checkpoint differs"


def test_offload_config_values():
    assert offload.parse({"offload_optimizer": {"device": "none"}}) is None
    with pytest.raises(ValueError, match="nvme_path' is required"):
        offload.parse({"offload_optimizer": {"device": "nvme"}})
    with pytest.raises(ValueError, match="device' = 'disk' is invalid"):
        offload.parse({"offload_optimizer": {"device": "disk"}})
