"""classification/train.py --tp N: the normal loop with a tensor-parallel model (classification/tp.py).

The real-model run trains the offline DistilBERT; its best checkpoint is checked independently:
predict.py loads it, and one process evaluating it unsharded on the same 16 test rows gets the
test loss the tp run logged (1e-5: the two differ only in summation order; a wrong shard or a
stale weight moves the loss by far more). The tiny-model runs check the loop's mechanics with
each engine (real DeepSpeed included): the LR schedule, per-tp-rank checkpoint files, resume
continuing the step count.
"""
import json
import os
import sys

import pytest

from conftest import run_cmd
from test_classification_train import COMMON, _metrics, _tiny_model, easy  # noqa: F401  (fixture)


@pytest.mark.parametrize("args,expect", [
    ("--tp 2 --engine zero --lora 4", "--lora (peft wraps the modules"),
    ("--tp 0", "--tp must be >= 1, got 0"),
])
def test_tp_refusals_at_start_up(args, expect, capsys):
    from classification.train import main
    with pytest.raises(SystemExit) as e:
        main(args.split())
    assert expect in str(e.value.code), e.value.code


@pytest.mark.slow
def test_tp_zero_real_model_test_split_and_predict(tmp_path):
    out = tmp_path / "tp"
    run_cmd(f"torchrun --standalone --nproc_per_node 2 classification/train.py --tp 2 --engine zero --max-steps 3 "
            f"--max-eval-samples 16 --output-dir {out}", timeout=500)
    m = _metrics(out)
    test = m[-1]
    assert test["event"] == "test" and test["tp"] == 2 and test["test_rows"] == 16 and 0 <= test["test_accuracy"] <= 1
    assert [x["step"] for x in m if x["event"] == "train"] == [1, 2, 3]
    files = sorted(os.listdir(out / "engine" / "last"))
    assert files == ["mp_rank_00_manifest.json", "mp_rank_00_zero_rank000.pt",
                     "mp_rank_01_manifest.json", "mp_rank_01_zero_rank000.pt"], files
    r = run_cmd(f"{sys.executable} classification/predict.py --checkpoint {out}/best 'a gripping, tender film'",
                timeout=120)
    assert "a gripping, tender film" in r.stdout
    # one process, the unsharded best checkpoint, the same 16 test rows: the same loss
    from classification import data as D
    from classification.loop import evaluate, tokenize
    from classification.predict import load_checkpoint
    model, tok, meta = load_checkpoint(str(out / "best"))
    bundle = D.load(D.DEFAULT_DATASET, D.SplitConfig(seed=0))
    texts, labels = bundle.test.texts[:16], bundle.test.labels[:16]
    ev = evaluate(model, tokenize(tok, texts, 64), labels, bundle.num_labels, tok.pad_token_id, 0, 1)
    assert abs(ev["loss"] - test["test_loss"]) < 1e-5 and ev["accuracy"] == test["test_accuracy"], (ev, test)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero", "ddp", "deepspeed"])
def test_tp_tiny_model_schedule_and_resume(easy, engine):  # noqa: F811
    model = _tiny_model(easy)
    out = easy / f"tp_{engine}"
    cmd = (f"torchrun --standalone --nproc_per_node 2 classification/train.py --tp 2 --engine {engine} "
           f"--model {model} --dataset {easy}/easy.jsonl --config {easy}/tiny.json {COMMON} --output-dir {out}")
    run_cmd(f"{cmd} --epochs 1", timeout=300)
    m1 = _metrics(out)
    train = [x for x in m1 if x["event"] == "train"]
    assert [x["step"] for x in train] == list(range(1, 21))       # 160 rows / (8 x dp 1)
    assert train[0]["lr"] == 0.0 and max(x["lr"] for x in train) == pytest.approx(2e-4)
    want = {"zero": ["mp_rank_00_manifest.json", "mp_rank_00_zero_rank000.pt", "mp_rank_01_manifest.json",
                     "mp_rank_01_zero_rank000.pt"],
            "ddp": ["mp_rank_00_ddp_state.pt", "mp_rank_01_ddp_state.pt"],
            "deepspeed": ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                          "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]}[engine]
    assert sorted(os.listdir(out / "engine" / "last")) == want
    r = run_cmd(f"{cmd} --epochs 2 --resume", timeout=300)
    assert "resumed from" in r.stdout
    new = _metrics(out)[len(m1):]
    assert [x["step"] for x in new if x["event"] == "train"][0] == 21 and new[-1]["steps"] == 40
    assert new[-1]["event"] == "test" and new[-1]["tp"] == 2
    r = run_cmd(f"torchrun --standalone --nproc_per_node 2 classification/train.py --tp 1 --engine {engine} "
                f"--model {model} --dataset {easy}/easy.jsonl --config {easy}/tiny.json {COMMON} --output-dir {out} "
                "--epochs 3 --resume", check=False, timeout=300)
    assert r.returncode != 0 and "tp is 2 there, 1 here" in r.stdout + r.stderr
    with open(out / "best" / "ringzero.json") as f:
        assert json.load(f)["tp"] == 2
