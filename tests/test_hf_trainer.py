"""recipes/hf_trainer.py (the Hugging Face Trainer with TrainingArguments(deepspeed=...)) on 2 ranks:
the real DeepSpeed vs ringzero's runner, per-step losses and the held-out predictions.

    python -m pytest -q -m slow tests/test_hf_trainer.py        (~9 min on 2 cores)

Both sides: `torchrun --nproc_per_node 2 clients/run.py SIDE recipes/hf_trainer.py --stage S`
(clients/run.py: the same start-up seed; SIDE deepspeed = the installed DeepSpeed 0.19.8, ringzero
= -m zero_from_scratch.as_deepspeed). fp32: each logged loss within 1e-5 relative (the reduction
order of the two engines' all-reduces may differ in the last bits), the held-out accuracy equal.
"""
import re

import pytest

from primitives.engine.launch import free_port
from tests.conftest import run_cmd


def _run(side: str, stage: int, accum: int, tmp_path, steps: int = 5, extra: str = "") -> tuple[list[float], str]:
    r = run_cmd(f"torchrun --nproc_per_node 2 --master_port {free_port()} clients/run.py {side} recipes/hf_trainer.py "
                f"--stage {stage} --grad-accum {accum} --steps {steps} --output-dir {tmp_path}/{side} {extra}",
                timeout=600)
    losses = [float(x) for x in re.findall(r"^STEP \d+ LOSS (\S+)$", r.stdout, re.M)]
    acc = re.search(r"^HELD-OUT ACCURACY (\S+)", r.stdout, re.M)
    assert losses and acc, r.stdout[-2000:]
    return losses, acc.group(1)


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage, accum", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_trainer_losses_equal_real_deepspeeds(stage, accum, tmp_path):
    """accum 2: the Trainer marks the accumulation boundary itself (set_gradient_accumulation_boundary)."""
    (ds, ds_acc), (rz, rz_acc) = (_run(side, stage, accum, tmp_path) for side in ("deepspeed", "ringzero"))
    assert len(ds) == len(rz) == 5
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(ds, rz)), (ds, rz)
    assert ds_acc == rz_acc


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_resume_continues_the_same_curve_under_the_runner(stage, tmp_path):
    """resume_from_checkpoint: the Trainer saves through engine.save_checkpoint (and at stage 3 reads
    engine.config like DeepSpeed's dict), then loads it with load_checkpoint(load_module_strict=...),
    restores its RNG and skips the batches it has seen: steps 4-6 equal the uninterrupted run's."""
    straight, acc = _run("ringzero", stage, 1, tmp_path, steps=6, extra="--save-every 3")
    assert len(straight) == 6
    resumed, acc2 = _run("ringzero", stage, 1, tmp_path, steps=6,
                         extra=f"--resume-from {tmp_path}/ringzero/checkpoint-3")
    assert resumed[-3:] == straight[3:], (straight, resumed)   # the Trainer's log history may hold steps 1-3 too
    assert acc == acc2
