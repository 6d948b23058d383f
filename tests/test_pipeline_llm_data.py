"""LLM data for the pipeline: the loss counts only answer tokens (instruct: the output;
conversation: the assistant turns; pretrain: everything), padding is ignored, a record whose
answer does not fit is an error; train_llm.py trains, exports to HF and generates (slow)."""
import json
import sys

import pytest
import torch

from recipes.llm_data import IGNORE, ByteTokenizer, detect, encode, load_dataset, make_example
from tests.conftest import run_cmd

TOK = ByteTokenizer()


def _learned(ids, labels) -> str:
    return TOK.decode(ids[labels != IGNORE])


def test_loss_only_on_answers():
    ids, labels = encode({"instruction": "Add 1 and 2.", "input": "", "output": "3."}, "instruct", 64)
    assert _learned(ids, labels) == "3.\n" and TOK.decode(ids[:16]) == "### Instruction:"
    conv = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                              {"from": "human", "value": "bye"}, {"from": "gpt", "value": "ciao"}]}
    ids, labels = encode(conv, detect(conv), 96)
    assert _learned(ids, labels) == "hello\nciao\n"
    ids, labels = encode({"text": "abc"}, "pretrain", 8)
    assert labels.tolist() == [97, 98, 99] + [IGNORE] * 5 and ids.tolist() == [97, 98, 99, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="match no format"):
        detect({"question": "?"})


def test_dataset_file_and_the_answer_that_does_not_fit(tmp_path):
    path = make_example(str(tmp_path / "ex.json"), n=8)
    ds = load_dataset(path, 64)
    assert len(ds) == 4 and ds.tensors[0].shape == (4, 64)
    conv = load_dataset(str(tmp_path / "ex_conversation.json"), 64)
    assert len(conv) == 4
    (tmp_path / "long.json").write_text(json.dumps([{"instruction": "x" * 100, "output": "y"}]))
    with pytest.raises(ValueError, match="keep no answer token within seq=64"):
        load_dataset(str(tmp_path / "long.json"), 64)


@pytest.mark.slow
def test_train_llm_trains_exports_and_generates(tmp_path):
    data = make_example(str(tmp_path / "ex.json"))
    r = run_cmd(f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 -m recipes.train_llm "
                f"--data {data} --pp 2 --steps 40 --dtype bf16 --lr 3e-3 --export-hf {tmp_path / 'hf'} "
                f"--prompt 'What is 2 plus 3?' --log-every 10", timeout=600)
    losses = [float(line.split("loss: ")[1].split()[0]) for line in r.stdout.splitlines() if line.startswith("steps: ")]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses
    assert "generate: '" in r.stdout and (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "hf_pipeline" / "latest").read_text() == "global_step40"
    assert torch.load(tmp_path / "hf_pipeline" / "global_step40" / "mp_rank_00_model_states.pt",
                      weights_only=False)["global_steps"] == 40
