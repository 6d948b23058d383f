"""DeepSpeed's tensorboard / csv_monitor sections honoured by the ZeRO engine (issue 13, item 3).

    python -m pytest -q tests/test_recipes_monitor.py

Two ranks, fp16 (so the loss scale is live), 4 optimizer steps with gradient accumulation 2.
The event files are read back with TensorBoard's own EventAccumulator and the CSV files with
the csv module; every value is checked against what the engine reported on rank 0 at that step,
and train_loss against the mean of EVERY rank's micro-batch losses (DeepSpeed's
_aggregate_total_loss), at stage 2 (the loss rides on the grad-norm all-reduce) and stage 0 (its
own 8-byte all-reduce).
"""
import csv
import os

import pytest
import torch

pytest.importorskip("tensorboard")

import zero_from_scratch  # noqa: E402
from zero_from_scratch.engine.models import TinyMLP  # noqa: E402

TAGS = ("lr", "loss_scale", "train_loss", "grad_norm", "samples_per_sec")


def _cfg(out, stage=2):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 3, "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage},
            "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb_job"},
            "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv_job"}}


def _train(rank, world, out, stage=2):
    torch.manual_seed(0)
    model = TinyMLP()
    engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(out, stage))
    seen = []
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        losses = []
        for _ in range(2):
            loss = engine(x=torch.randn(4, 13, generator=g), labels=torch.randint(0, 3, (4,), generator=g)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        seen.append({"lr": engine.get_lr()[0], "loss_scale": engine.loss_scaler.loss_scale,
                     "train_loss": sum(losses) / 2, "grad_norm": engine.get_global_grad_norm()})
    rows = engine.comm_report(print_table=False)["rows"]
    return seen, sorted({r["purpose"] for r in rows})


@pytest.mark.parametrize("stage", [2, 0])
def test_tensorboard_and_csv_events_match_the_engine(spawn, tmp_path, stage):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    res = spawn(_train, 2, args=(str(tmp_path), stage))
    seen = [dict(s, train_loss=(s["train_loss"] + o["train_loss"]) / 2) for s, o in zip(res[0][0], res[1][0])]
    assert all(s["train_loss"] != o["train_loss"] for s, o in zip(res[0][0], res[1][0]))   # ranks differ
    extra = "monitor loss all-reduce"                        # its own round only where none exists
    assert all((extra in purposes) == (stage == 0) for _, purposes in res), [p for _, p in res]
    acc = EventAccumulator(str(tmp_path / "tb_job"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(f"Train/Samples/{t}" for t in TAGS)
    rows = {}
    for t in TAGS:
        ev = acc.Scalars(f"Train/Samples/{t}")
        assert [e.step for e in ev] == [16, 32, 48, 64], t        # x = samples: steps × 2 micro × 4 rows × 2 ranks
        rows[t] = [e.value for e in ev]
        with open(tmp_path / "csv_job" / f"Train_Samples_{t}.csv") as f:
            r = list(csv.reader(f))
        assert r[0] == ["step", t] and [int(x[0]) for x in r[1:]] == [16, 32, 48, 64]
        if t != "samples_per_sec":
            assert [float(x[1]) for x in r[1:]] == pytest.approx([s[t] for s in seen], rel=1e-12)
    for t in ("lr", "loss_scale", "train_loss", "grad_norm"):   # TensorBoard stores float32
        assert rows[t] == pytest.approx([s[t] for s in seen], rel=1e-6), t
    assert rows["lr"][0] != rows["lr"][-1] and all(v > 0 for v in rows["samples_per_sec"])
    assert not os.path.exists(tmp_path / "tb_job" / "Train_Samples_lr.csv")


def _unwritable(rank, world, out):
    torch.manual_seed(0)
    zero_from_scratch.initialize(model=TinyMLP(), config=_cfg(out))


def test_unwritable_monitor_path_fails_on_every_rank(spawn, tmp_path):
    blocker = tmp_path / "a_file"          # output_path below a regular file: fails even as root
    blocker.write_text("")
    res = spawn(_unwritable, 2, args=(str(blocker),), allow_fail=True)
    for r, (status, value) in enumerate(res):
        assert status == "error" and f"rank {r}: cannot start the tensorboard/csv_monitor monitor" in value, value


def test_bad_monitor_keys_are_refused():
    from zero_from_scratch.engine.monitor import parse
    with pytest.raises(ValueError, match=r"tensorboard.path"):
        parse({"tensorboard": {"enabled": True, "path": "x"}})
