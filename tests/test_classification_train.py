"""classification/train.py and predict.py end to end, on an easy synthetic signal and tiny sizes."""
import json
import os
import shutil
import sys

import pytest

from conftest import run_cmd
from primitives.launch import free_port

POS = ["wonderful", "brilliant", "superb", "delightful", "moving", "excellent", "great", "charming"]
NEG = ["awful", "terrible", "boring", "dreadful", "dull", "horrible", "bad", "tedious"]
NOUNS = ["film", "movie", "story", "cast", "script", "picture", "ending", "drama", "comedy", "thriller"]
TINY = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": "auto",
                      "warmup_num_steps": "auto", "warmup_type": "linear", "total_num_steps": "auto"}},
        "gradient_clipping": 1.0, "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
        "steps_per_print": 1000000}
COMMON = "--max-len 16 --lr 2e-4 --warmup-frac 0.2 --dropout 0.0"


@pytest.fixture(scope="module")
def easy(tmp_path_factory):
    """200 rows: a positive or negative adjective decides the label (chance = 50%)."""
    d = tmp_path_factory.mktemp("cls")
    with open(d / "easy.jsonl", "w") as f:
        for i in range(200):
            lab = i % 2
            adj = (POS if lab else NEG)[(i // 2) % 8]
            f.write(json.dumps({"text": f"the {NOUNS[i % 10]} was {adj}", "label": lab}) + "\n")
    with open(d / "tiny.json", "w") as f:
        json.dump(TINY, f)
    return d


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow      # the default suite runs the launcher in the demo's test and chapter 07 (train, then predict)
@pytest.mark.deepspeed
def test_deepspeed_launcher_two_ranks_then_predict(easy):
    """Two epochs under DeepSpeed's launcher learn the task (test accuracy ≥ 0.8) and predict.py reads the best."""
    out = easy / "ds"
    r = run_cmd(f"deepspeed --num_gpus 2 --master_port {free_port()} classification/train.py "
                f"--dataset {easy}/easy.jsonl --config {easy}/tiny.json --epochs 2 {COMMON} --output-dir {out}",
                timeout=300)
    assert "resolved configuration" in r.stdout and 'fp16.enabled "auto" resolved to OFF' in r.stdout
    m = _metrics(out)
    train = [x for x in m if x["event"] == "train"]
    # 160 training rows / (8 x 2 ranks) = 10 steps per epoch
    assert [x["step"] for x in train] == list(range(1, 21))
    assert train[0]["lr"] == 0.0 and max(x["lr"] for x in train) == pytest.approx(2e-4)  # DeepSpeed's warm-up start
    first, last = sum(x["loss"] for x in train[:3]) / 3, sum(x["loss"] for x in train[-3:]) / 3
    assert last < first - 0.1, (first, last)
    assert [x["epoch"] for x in m if x["event"] == "eval"] == [1, 2]
    test = [x for x in m if x["event"] == "test"][0]
    assert test["world_size"] == 2 and test["engine"] == "deepspeed" and test["test_rows"] == 20
    assert test["test_accuracy"] >= 0.8  # chance is 0.5; the adjective decides the label
    r = run_cmd(f"{sys.executable} classification/predict.py --checkpoint {out}/best "
                "'the movie was brilliant and superb' 'the script was awful and tedious'", timeout=120)
    lines = [line for line in r.stdout.splitlines() if "the movie was" in line or "the script was" in line]
    assert "1" in lines[0].split("│")[2] and "0" in lines[1].split("│")[2], r.stdout


@pytest.mark.deepspeed
def test_single_process_resume_and_checkpoint_errors(easy):
    out, rows = easy / "single", "--max-train-samples 64"   # 8 steps an epoch: resuming needs no learning
    model = _tiny_model(easy)                                # what is checked is the bookkeeping, not DistilBERT
    run_cmd(f"{sys.executable} classification/train.py --dataset {easy}/easy.jsonl --config {easy}/tiny.json "
            f"--model {model} --epochs 1 {COMMON} {rows} --output-dir {out}", timeout=240)
    m1 = _metrics(out)
    assert m1[-1]["event"] == "test" and m1[-1]["world_size"] == 1 and m1[-1]["steps"] == 8  # 64 / 8
    r = run_cmd(f"{sys.executable} classification/train.py --dataset {easy}/easy.jsonl --config {easy}/tiny.json "
                f"--model {model} --epochs 2 {COMMON} {rows} --output-dir {out} --resume", timeout=240)
    assert "resumed from" in r.stdout
    m2 = _metrics(out)
    assert m2[:len(m1)] == m1  # appended, not rewritten
    new = m2[len(m1):]
    assert [x["step"] for x in new if x["event"] == "train"][0] == 9  # continues, does not restart
    assert [x["epoch"] for x in new if x["event"] == "eval"] == [2] and new[-1]["steps"] == 16
    # resuming with a different setup is refused, naming what differs
    r = run_cmd(f"{sys.executable} classification/train.py --dataset {easy}/easy.jsonl --config {easy}/tiny.json "
                f"--model {model} --epochs 3 --max-len 32 {rows} --output-dir {out} --resume", check=False, timeout=240)
    assert r.returncode != 0 and "belongs to another run: max_len is 16 there, 32 here" in r.stderr + r.stdout
    # a checkpoint folder whose weights are another model's
    bad = easy / "bad_ckpt"
    shutil.copytree(out / "best", bad)
    from classification.model import offline_model_dir
    shutil.copy(offline_model_dir() / "config.json", bad / "config.json")  # a BertModel config
    from classification.predict import main as predict   # in-process: the same main() the command line runs
    with pytest.raises(SystemExit, match="config.json says BertModel"):
        predict(["--checkpoint", str(bad), "fine"])


def test_missing_config_fails_loudly_from_the_command_line():
    """The seed's trap: --deepspeed_config pointing nowhere was silently ignored."""
    r = run_cmd(f"{sys.executable} classification/train.py --deepspeed_config /no/such.json", check=False, timeout=120)
    assert r.returncode != 0 and "config '/no/such.json' does not exist" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,expect", [
    ("--config /no/such.json", "config '/no/such.json' does not exist"),
    ("--dataset /no/such.csv", "--dataset /no/such.csv: no such file"),
    ("--config a.json --deepspeed_config b.json", "disagree; pass one"),
    ("--epochs 0", "--epochs must be >= 1"),
    ("--max-steps -1", "--max-steps must be >= 0"),
])
def test_bad_arguments_are_clear_errors(args, expect, capsys):
    from classification.train import main
    with pytest.raises(SystemExit) as e:
        main(args.split())
    assert e.value.code != 0
    assert expect in str(e.value.code) + capsys.readouterr().err


def _engine_available(kind):
    try:
        if kind == "zero":
            import zero_from_scratch
            return hasattr(zero_from_scratch, "initialize")
        import ddp_examples
        return hasattr(ddp_examples, "BucketedDataParallel")
    except ImportError:
        return False


# slow: the default suite runs both engines through torchrun + train.py elsewhere (the ZeRO-3 run below,
# the LoRA run of test_recipes_lora.py); these two train to accuracy 0.8, ~15 s each
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero", "ddp"])
def test_other_engines_under_torchrun(easy, kind):
    assert _engine_available(kind), f"--engine {kind}: its package does not provide the engine API"
    out = easy / kind
    run_cmd(f"torchrun --standalone --nproc_per_node 2 classification/train.py --engine {kind} "
            f"--dataset {easy}/easy.jsonl --config {easy}/tiny.json --epochs 2 {COMMON} --output-dir {out}", timeout=300)
    m = _metrics(out)
    train = [x for x in m if x["event"] == "train"]
    assert [x["step"] for x in train] == list(range(1, 21)) and train[0]["lr"] == 0.0
    assert sum(x["loss"] for x in train[-3:]) < sum(x["loss"] for x in train[:3]) - 0.3
    test = m[-1]
    assert test["engine"] == kind and test["world_size"] == 2 and test["test_accuracy"] >= 0.8


def _tiny_model(easy):
    """A dim-32 DistilBERT (FFN 64) over the real vocabulary, saved once with the offline tokenizer: --model DIR."""
    d = easy / "tiny_model"
    if not d.is_dir():
        from classification.model import VOCAB_SIZE, load_tokenizer, offline_model_dir
        from zero_from_scratch.engine.models import tiny_distilbert
        tiny_distilbert(vocab=VOCAB_SIZE, hidden=64, max_positions=512, seed=0).save_pretrained(d)
        load_tokenizer(offline_model_dir()).save_pretrained(d)
    return d


@pytest.mark.parametrize("engine", ["zero", pytest.param("deepspeed", marks=[pytest.mark.slow, pytest.mark.deepspeed])])
def test_zero3_trains_evaluates_and_saves_a_model_predict_loads(easy, engine):
    """ZeRO-3 through train.py: parameters are 1/N per rank outside forward, so evaluation must run
    the same number of batches on every rank and save_pretrained / the best-checkpoint reload must
    see gathered weights. 19 eval rows at 2 ranks: 10 and 9 per rank."""
    out = easy / f"zero3_{engine}"
    cfg = dict(TINY, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    with open(easy / "zero3.json", "w") as f:
        json.dump(cfg, f)
    launch = (f"deepspeed --num_gpus 2 --master_port {free_port()}" if engine == "deepspeed"
              else "torchrun --standalone --nproc_per_node 2")
    model = _tiny_model(easy)
    run_cmd(f"{launch} classification/train.py --engine {engine} --model {model} "
            f"--dataset {easy}/easy.jsonl --config {easy}/zero3.json --epochs 1 --max-steps 4 "
            f"--max-eval-samples 19 {COMMON} --output-dir {out}", timeout=300)
    m = _metrics(out)
    assert [x["step"] for x in m if x["event"] == "train"] == [1, 2, 3, 4]
    ev = [x for x in m if x["event"] == "eval"][0]
    assert ev["n"] == 19                               # every row once, none twice (the padding row has weight 0)
    test = m[-1]
    assert test["event"] == "test" and test["test_rows"] == 19
    from safetensors.torch import load_file
    w = load_file(str(out / "best" / "model.safetensors"))
    assert w and all(t.numel() > 0 for t in w.values())   # gathered, not ZeRO-3's size-0 placeholders
    r = run_cmd(f"{sys.executable} classification/predict.py --checkpoint {out}/best 'the movie was superb'", timeout=120)
    assert "the movie was superb" in r.stdout


def test_eval_batches_equal_on_every_rank_and_cover_each_row_once():
    import numpy as np
    from classification.batches import eval_batches
    for n, world, batch in [(129, 2, 64), (19, 2, 64), (5, 4, 2), (1, 3, 8), (64, 2, 32)]:
        order = np.random.default_rng(n).permutation(n)
        per = [eval_batches(n, order, r, world, batch) for r in range(world)]
        assert len({len(p) for p in per}) == 1, (n, world, batch)
        counted = sorted(i for p in per for idx, keep in p for i in idx[:keep])
        assert counted == list(range(n))
