"""TRL's SFTTrainer, DPOTrainer and RewardTrainer with LoRA at ZeRO-2 and ZeRO-3 (at ZeRO-3 also with gradient
checkpointing, TRL's default, and SFT / DPO without LoRA), fp32, 2 ranks: real DeepSpeed 0.19.8 against ringzero's
runner (tests/hf_suites/trl_trainers.py, compared by tests/hf_suites/trl_compare.py).

    python -m pytest -q -m slow tests/test_hf_trl.py        (~1 min per case on 2 cores when idle)
    python -m tests.hf_suites.trl_compare                   (the same cases as a table)

Each case: the per-step training losses, the eval loss and every tensor of the saved LoRA adapter within
1e-5 relative (the reason is in trl_compare.py). At ZeRO-3 SFT and DPO score tokens through TRL's fused
LM head, which reads `lm_head.weight` in GatheredParameters, saves it and gathers it again in backward.
The default suite holds none of these (two 2-rank runs with TRL's imports are ~1 min); the fused head's
mechanism is in its default suite in tests/test_hf_fused_head.py.
"""
import pytest

from tests.hf_suites.trl_compare import CASES, TOL, compare


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("name", list(CASES))
def test_trl_trainer_equals_real_deepspeed(name):
    pytest.importorskip("trl")
    c = compare(name)
    assert c["same_steps"] and c["steps"] == 4, c["runs"]["ringzero"]["losses"]
    assert c["loss_rel"] <= TOL, (c["runs"]["deepspeed"]["losses"], c["runs"]["ringzero"]["losses"])
    assert c["eval_rel"] <= TOL, (c["runs"]["deepspeed"]["eval"], c["runs"]["ringzero"]["eval"])
    assert c["same_tensors"] and c["n_tensors"] >= 8 and c["weight_rel"] <= TOL, c["weight_rel"]
