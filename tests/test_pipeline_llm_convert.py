"""Hugging Face ↔ pipeline weights for llama: the round trip is bit for bit (tied and untied), the
pipeline engine starts from converted weights with HF's loss, and after training the weights
converted back load into LlamaForCausalLM, give the pipeline's logits and run model.generate."""
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from pipeline_parallel.convert import hf_to_pp, main, pp_to_hf
from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.models import llama_layers, llama_loss, llama_model

SEQ, B, M = 16, 2, 2


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_bit_exact(tmp_path, tied):
    model = llama_model("tiny", seed=3, tie_word_embeddings=tied)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    main(["hf_to_pp", "--input-path", str(tmp_path / "hf"), "--save-path", str(tmp_path / "pp")])
    files = sorted(os.listdir(tmp_path / "pp" / "global_step0"))
    n = model.config.num_hidden_layers
    assert len(files) == n + (2 if tied else 3)
    main(["pp_to_hf", "--input-path", str(tmp_path / "pp"), "--save-path", str(tmp_path / "back")])
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k


def batch(step, mb):
    g = torch.Generator().manual_seed(1000 * step + mb)
    ids = torch.randint(0, 256, (B, SEQ), generator=g)
    return ids, ids.clone()


def _train_from_converted(rank, world, pp_dir, ckpt):
    net = PipelineModule(llama_layers(llama_model("tiny", seed=9).train()), num_stages=2, loss_fn=llama_loss)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine = initialize(model=net, config=cfg)[0]
    engine.load_checkpoint(pp_dir, load_module_only=True)
    first = float(engine.eval_batch(iter([batch(0, i) for i in range(M)])))
    for t in range(3):
        engine.train_batch(iter([batch(t, i) for i in range(M)]))
    engine.save_checkpoint(ckpt)
    return first


def test_train_from_hf_then_back_and_generate(spawn, tmp_path):
    model = llama_model("tiny", seed=3)
    model.save_pretrained(tmp_path / "hf")
    hf_to_pp(str(tmp_path / "hf"), str(tmp_path / "pp"))
    first = spawn(_train_from_converted, 2, args=(str(tmp_path / "pp"), str(tmp_path / "ckpt")))[0]
    with torch.no_grad():
        ref = sum(float(model(input_ids=x, labels=y).loss) for x, y in (batch(0, i) for i in range(M))) / M
    assert first == pytest.approx(ref, rel=1e-6)                 # the engine started from the HF weights
    pp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "trained"), config_path=str(tmp_path / "hf"))
    trained = LlamaForCausalLM.from_pretrained(tmp_path / "trained").eval()
    net = PipelineModule(llama_layers(llama_model("tiny", seed=9)), num_stages=1, loss_fn=llama_loss)
    sd = {}
    for f in sorted(os.listdir(tmp_path / "ckpt" / "global_step3")):
        if f.startswith("layer_"):
            i = int(f[6:8])
            sd.update({f"{i}.{k}": v for k, v in torch.load(tmp_path / "ckpt" / "global_step3" / f).items()})
    net.load_state_dict(sd)
    ids = batch(5, 0)[0]
    with torch.no_grad():
        assert torch.equal(trained(input_ids=ids).logits, net(ids))
        assert not torch.equal(trained(input_ids=ids).logits, model(input_ids=ids).logits)   # it did train
        out = trained.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)
