"""Frozen parameters and LoRA under ZeRO (zero_from_scratch/engine/lora.py, frozen.py).

    python -m pytest -q tests/test_recipes_lora.py          (+ -m slow for stages 1 and 2 vs DeepSpeed)

* peft-LoRA tiny DistilBERT vs real DeepSpeed, step by step (loss, grad norm, lr every step; every
  final parameter, adapters and frozen weights): ZeRO-3 by default, ZeRO-1/2 behind `slow`. fp32
  tolerances are parity.zero.compare.Tolerance.for_run (1e-5 relative on loss and norm).
* ZeRO-3 partitions the frozen weights (empty .data outside forward, Ψ_frozen/N per rank), never
  gives them optimizer state, and a checkpoint round trip restores them.
* LoRA r = 8 at stage 2: the measured model-state bytes equal the paper's formula with trainable Ψ.
* Bad target modules: a LoraError naming the rank, the targets and the linears that exist.
"""
import pytest
import torch

pytest.importorskip("peft")

import zero_from_scratch  # noqa: E402
from zero_from_scratch.engine.lora import LoraError, apply_lora, tiny_lora_distilbert, trainable_counts  # noqa: E402

M = "zero_from_scratch.engine.lora:tiny_lora_distilbert"


def _pairs(stages):
    from parity.zero.harness import Job
    from parity.zero.ds_parity import make_config
    return [(Job("deepspeed", M, make_config(s, clip=0.2), 4), Job("ours", M, make_config(s, clip=0.2), 4))
            for s in stages]


def _parity(stages):
    from zero_from_scratch.engine.models import make_batches
    from parity.zero.ds_parity import run_parities
    res = run_parities(_pairs(stages), 2, batches={(M, 4): make_batches("distilbert", 8, 8, seed=1)}, timeout=600)
    bad = [f"ZeRO-{s}: " + "; ".join(r.failures) for s, r in zip(stages, res) if not r.ok]
    assert not bad, "\n".join(bad)
    for r in res:
        assert any(x["grad_norm_ref"] > 0.2 for x in r.rows), "clipping never engaged"
    return res


@pytest.mark.deepspeed
def test_lora_zero3_matches_deepspeed():
    pytest.importorskip("deepspeed")
    _parity((3,))


@pytest.mark.deepspeed
@pytest.mark.slow
def test_lora_zero1_zero2_match_deepspeed():
    pytest.importorskip("deepspeed")
    _parity((1, 2))


CFG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"input_ids": torch.randint(1, 101, (2, 10), generator=g), "labels": torch.randint(0, 2, (2,), generator=g)}


def _lora_stage3(rank, world, ckpt_dir):
    torch.manual_seed(0)
    model = tiny_lora_distilbert()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen0 = {n: v for n, v in init.items() if not model.get_parameter(n).requires_grad}
    engine, *_ = zero_from_scratch.initialize(model=model, config={**CFG, "zero_optimization": {"stage": 3}})
    empty = all(p.numel() == 0 for p in model.parameters())
    for step in range(2):
        engine.backward(engine(**_batch(step, rank)).loss)
        engine.step()
    rep = engine.memory_report(print_table=False)
    engine.save_checkpoint(ckpt_dir, tag="t")
    with engine.gathered_parameters(model.parameters()):
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    with engine.gathered_parameters([p for n, p in model.named_parameters() if n in frozen0], modifier_rank=0):
        for n, p in model.named_parameters():
            if n in frozen0:
                p.data.zero_()                    # clobber the frozen weights, then restore them
    engine.load_checkpoint(ckpt_dir, tag="t")
    with engine.gathered_parameters(model.parameters()):
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_elems = sum(s["exp_avg"].numel() for s in engine.optimizer.state)
    return {"empty": empty, "rep": rep, "opt_elems": opt_elems, "padded": engine.layout.padded,
            "frozen_same": all(torch.equal(frozen0[n], after[n]) for n in frozen0),
            "restored": all(torch.equal(after[n], loaded[n]) for n in after),
            "trainable_moved": all(not torch.equal(after[n], v) for n, v in init.items() if n not in frozen0)}


def _both(rank, world, ckpt_dir):   # one spawn for both tests: peft's import is paid once
    return _lora_stage3(rank, world, ckpt_dir), _lora_stage2_memory(rank, world)


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    from primitives.launch import spawn
    return spawn(_both, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=300.0)


def test_zero3_partitions_frozen_params_and_checkpoints_them(engine_runs):
    res = [r[0] for r in engine_runs]
    torch.manual_seed(0)
    trainable, frozen = trainable_counts(tiny_lora_distilbert())
    for r, x in enumerate(res):
        assert x["empty"], f"rank {r}: stage 3 left a parameter (frozen?) full outside forward"
        fz = x["rep"]["frozen"]
        assert (fz["trainable_psi"], fz["frozen_psi"]) == (trainable, frozen)
        # padding: < N elements per frozen unit; a full copy would be 2x this
        assert frozen * 4 / 2 <= fz["frozen_bytes"] < (frozen / 2 + 2 * 40) * 4
        assert x["opt_elems"] == x["padded"] // 2, "optimizer state must cover the trainable shard only"
        assert x["frozen_same"] and x["trainable_moved"] and x["restored"]


def _lora_stage2_memory(rank, world):
    torch.manual_seed(0)
    from zero_from_scratch.engine.models import tiny_distilbert
    model = apply_lora(tiny_distilbert(), 8)
    engine, *_ = zero_from_scratch.initialize(model=model, config={**CFG, "zero_optimization": {"stage": 2}})
    engine.backward(engine(**_batch(0, rank)).loss)
    engine.step()
    return engine.memory_report(print_table=False)


def test_lora_r8_stage2_model_states_equal_formula_with_trainable_psi(engine_runs):
    from zero_from_scratch.engine.ledger import model_state_bytes
    rep = engine_runs[0][1]
    torch.manual_seed(0)
    from zero_from_scratch.engine.models import tiny_distilbert
    trainable, frozen = trainable_counts(apply_lora(tiny_distilbert(), 8))
    assert rep["psi"] == trainable and rep["frozen"]["frozen_psi"] == frozen
    assert rep["total_measured"] == sum(model_state_bytes(2, rep["padded_psi"], 2, False).values())
    assert rep["frozen"]["frozen_bytes"] == 4 * frozen          # stages 0-2 keep frozen weights whole
    full = sum(model_state_bytes(2, trainable + frozen, 2, False).values())
    assert rep["total_measured"] < full / 4, "LoRA must shrink the model states"


def test_bad_lora_targets_are_a_clear_error():
    from zero_from_scratch.engine.models import tiny_distilbert
    with pytest.raises(LoraError, match=r"rank 1: LoRA target modules \['nope'\] do not exist.*q_lin"):
        apply_lora(tiny_distilbert(), 4, targets=["q_lin", "nope"], rank=1)
    with pytest.raises(LoraError, match="positive int"):
        apply_lora(tiny_distilbert(), 0)


@pytest.fixture(scope="module")
def easy_data(tmp_path_factory):
    import json

    from test_classification_train import NEG, NOUNS, POS, TINY
    d = tmp_path_factory.mktemp("lora_cls")
    with open(d / "easy.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"the {NOUNS[i % 10]} was {(POS if i % 2 else NEG)[(i // 2) % 8]}",
                                "label": i % 2}) + "\n")
    with open(d / "tiny.json", "w") as f:
        json.dump(TINY, f)
    return d


ARGS = "--max-len 16 --lr 2e-3 --warmup-frac 0.2 --dropout 0.0"


@pytest.mark.slow
def test_train_py_bad_lora_targets_fail_on_every_rank(easy_data):
    from conftest import run_cmd
    r = run_cmd(f"torchrun --standalone --nproc_per_node 2 classification/train.py --engine zero --lora 4 "
                f"--lora-targets q_lin,query --dataset {easy_data}/easy.jsonl --config {easy_data}/tiny.json {ARGS} "
                f"--output-dir {easy_data}/bad", check=False, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: LoRA target modules ['query'] do not exist" in out, out[-3000:]


def _predict_rows(best, data):
    """predict.py's loader on the test split train.py evaluated: (evaluate()'s numbers, predict()'s labels)."""
    from classification import data as D
    from classification.batches import tokenize
    from classification.evaluate import evaluate
    from classification.predict import load_checkpoint, predict
    model, tok, meta = load_checkpoint(str(best))
    test = D.load(str(data), D.SplitConfig(seed=0)).test
    ids = tokenize(tok, test.texts, meta["max_len"])
    ev = evaluate(model, ids, test.labels, meta["num_labels"], tok.pad_token_id, 0, 1)
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    saved, have = load_file(str(best / "adapter_model.safetensors")), get_peft_model_state_dict(model)
    ev["weights_loaded"] = sorted(saved) == sorted(have) and all(torch.equal(saved[k], have[k]) for k in saved)
    ev["adapters_trained"] = all(saved[k].abs().max() > 0 for k in saved if "lora_B" in k)   # peft inits B = 0
    names = meta["label_names"]
    return ev, [names.index(label) for label, _ in predict(model, tok, meta, test.texts)], test.labels


def test_train_py_lora_ddp_then_predict_reads_the_lora_checkpoint(easy_data):
    """The cheap LoRA CLI run of the default suite: the tiny random DistilBERT (dim 32) over the real
    vocabulary, --engine ddp, one epoch (10 steps: too few for it to beat chance, so the check is
    the loss); then predict.py rebuilds base + LoRA from the checkpoint and reproduces the test
    accuracy and loss train.py reported on the same rows (the loss to float rounding), with every
    saved adapter and head tensor in place (and every lora_B moved off peft's zero init)."""
    import json

    from conftest import run_cmd
    from test_classification_train import _tiny_model
    out, model = easy_data / "lora_cli", _tiny_model(easy_data)
    run_cmd(f"torchrun --standalone --nproc_per_node 2 classification/train.py --engine ddp --lora 8 --model {model} "
            f"--dataset {easy_data}/easy.jsonl --config {easy_data}/tiny.json --epochs 1 --max-len 16 --lr 2e-2 "
            f"--warmup-frac 0.2 --dropout 0.0 --output-dir {out}", timeout=300)
    test = [json.loads(x) for x in open(out / "metrics.jsonl")][-1]
    assert not (out / "best" / "model.safetensors").exists() and (out / "best" / "adapter_model.safetensors").is_file()
    ev, labels, truth = _predict_rows(out / "best", easy_data / "easy.jsonl")
    assert ev["n"] == test["test_rows"] == len(labels) == 20
    assert ev["accuracy"] == test["test_accuracy"], (ev, test)
    assert ev["loss"] == pytest.approx(test["test_loss"], rel=1e-5)
    assert ev["weights_loaded"] and ev["adapters_trained"], ev
    assert sum(p == t for p, t in zip(labels, truth)) / len(truth) == test["test_accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero", "ddp", "deepspeed"])
def test_train_py_lora_under_torchrun(easy_data, kind):
    import json

    from conftest import run_cmd
    out = easy_data / f"lora_{kind}"
    run_cmd(f"torchrun --standalone --nproc_per_node 2 classification/train.py --engine {kind} --lora 8 "
            f"--dataset {easy_data}/easy.jsonl --config {easy_data}/tiny.json --epochs 2 {ARGS} --output-dir {out} "
            f"--tensorboard {out}/tb", timeout=600)
    m = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert m[-1]["test_accuracy"] >= 0.8 and (out / "best" / "adapter_model.safetensors").is_file()
    ev, _, _ = _predict_rows(out / "best", easy_data / "easy.jsonl")   # the default (MiniLM) base model
    assert ev["accuracy"] == m[-1]["test_accuracy"] and ev["loss"] == pytest.approx(m[-1]["test_loss"], rel=1e-5)


def test_predict_refuses_an_incomplete_or_mixed_lora_checkpoint(tmp_path):
    import json

    from classification.predict import load_checkpoint
    (tmp_path / "ringzero.json").write_text(json.dumps({"model": "m", "num_labels": 2, "lora": 8}))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_lin"]}))
    with pytest.raises(SystemExit, match=r"missing: \['adapter_model.safetensors'\]"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"adapter_config.json says r=4 but ringzero.json says lora=8"):
        load_checkpoint(str(tmp_path))
