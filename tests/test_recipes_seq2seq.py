"""The seq2seq recipe (issue 13, item 6).

    python -m pytest -q tests/test_recipes_seq2seq.py        (+ -m slow: a short run under torchrun)

The grammar: deterministic, held-out questions never in training, every word in the vocabulary
(no <unk>), encode/decode round trip. The slow test trains 100 steps of ZeRO-3 + nvme offload under
torchrun and checks the run's record; the other slow test runs the default recipe (ZeRO-1, 1200
steps, ~4-9 min on 2 cores) and holds it to the issue's bar: held-out exact match >= 0.9.
"""
import json

import pytest

from seq2seq.grammar import Vocab, dataset


def test_grammar_is_deterministic_disjoint_and_fully_covered():
    tr, te = dataset(2000, 200, seed=3)
    assert (tr, te) == dataset(2000, 200, seed=3)
    assert not {q for q, _ in tr} & {q for q, _ in te}
    v = Vocab()
    for q, s in tr + te:
        for text in (q, s):
            ids = v.encode(text)
            assert 2 not in ids and ids[-1] == 1 and v.decode(ids) == text
    kinds = {s.split()[1] == "COUNT" for _, s in tr} | {"ORDER BY" in s for _, s in tr} | {" AND " in s for _, s in tr}
    assert kinds == {True, False}


@pytest.mark.slow
def test_zero3_nvme_offload_recipe_runs_under_torchrun(tmp_path):
    from conftest import run_cmd
    from primitives.launch import free_port
    run_cmd(f"torchrun --nproc_per_node 2 --master_port {free_port()} seq2seq/train.py --engine zero "
            f"--config seq2seq/ds_config_zero3_offload.json --steps 100 --train-size 2000 --test-size 20 "
            f"--output-dir {tmp_path}", timeout=600)
    rec = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    final = rec[-1]
    assert final["stage"] == 3 and final["offload"] == "nvme" and len(final["peak_rss_per_rank"]) == 2
    # mean loss of steps 1-50 vs 51-100: 4.27 → 1.12 in a run here; 0.5 is far above run-to-run noise
    assert rec[0]["step"] == 50 and rec[0]["loss"] > final["final_loss"] + 0.5
    assert sorted((tmp_path / "nvme" / "zero_rank000").iterdir())


@pytest.mark.slow
def test_default_recipe_reaches_the_exact_match_bar(tmp_path):
    """The recipe as a user runs it (ZeRO-1, the shipped config and step count): >= 0.9 exact match on
    500 held-out questions. Every token of a ~15-token query must be right (numbers copied, synonyms
    mapped, optional clauses decided), so 0.9 is far from chance; the 100-step runs of
    seq2seq.memory_table score ~0.01."""
    from conftest import run_cmd
    from primitives.launch import free_port
    run_cmd(f"torchrun --nproc_per_node 2 --master_port {free_port()} seq2seq/train.py --engine zero "
            f"--output-dir {tmp_path}", timeout=1500)
    final = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")][-1]
    assert final["event"] == "final" and final["steps"] == 1200 and final["stage"] == 1
    assert final["exact_match"] >= 0.9, final
