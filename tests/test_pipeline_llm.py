"""A llama-family model (transformers' LlamaForCausalLM, tiny preset, random init offline) as a
pipeline: the layer list on one process gives HF's logits and loss; on 2 stages our engine's
losses equal one process; fp32 per-step losses equal DeepSpeed's pipeline engine at pp = 2 (slow)."""
import pytest
import torch

from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.models import llama_layers, llama_loss, llama_model

SEQ, B, M = 16, 2, 2


def batch(step, mb, vocab=256):
    g = torch.Generator().manual_seed(1000 * step + mb)
    ids = torch.randint(0, vocab, (B, SEQ), generator=g)
    return ids, ids.clone()


def config(lr=1e-3):
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": 0.0}


@pytest.mark.parametrize("tied", [False, True])
def test_layers_on_one_process_equal_hf(tied):
    model = llama_model("tiny", tie_word_embeddings=tied)
    net = PipelineModule(llama_layers(model), num_stages=1, loss_fn=llama_loss)
    assert len(net.layers) == model.config.num_hidden_layers + 3
    ids, labels = batch(0, 0)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        logits = net(ids)
    assert torch.equal(logits, ref.logits)
    assert float(llama_loss(logits, labels)) == pytest.approx(float(ref.loss), rel=1e-6)
    n_hf = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in net.parameters()) == n_hf


def _reference(steps, lr=1e-3, tied=False):
    model = llama_model("tiny", tie_word_embeddings=tied).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for t in range(steps):
        total = 0.0
        for i in range(M):
            ids, labels = batch(t, i)
            loss = model(input_ids=ids, labels=labels).loss / M
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _ours(rank, world, steps, tied):
    net = PipelineModule(llama_layers(llama_model("tiny", tie_word_embeddings=tied).train()), num_stages=2,
                         loss_fn=llama_loss, partition_method="uniform")
    engine, *_ = initialize(model=net, config=config(), model_parameters=[p for p in net.parameters()])
    return [float(engine.train_batch(iter([batch(t, i) for i in range(M)]))) for t in range(steps)]


def _deepspeed(rank, world, steps):
    from parity.zero.sides import prepare_deepspeed   # DeepSpeed: the reference side only
    deepspeed = prepare_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.pipe import PipelineModule as DSPipelineModule   # deepspeed: optional, the reference
    net = DSPipelineModule(layers=llama_layers(llama_model("tiny").train()), num_stages=2, loss_fn=llama_loss,
                           partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                      config=config())
    return [float(engine.train_batch(data_iter=iter([batch(t, i) for i in range(M)]))) for t in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_two_stages_equal_one_process(spawn, tied):
    # one rounding per element from accumulating micro-batch gradients separately (parity/pipeline.py)
    out = spawn(_ours, 2, args=(2, tied))
    ref = _reference(2, tied=tied)
    for rank in range(2):
        assert out[rank] == pytest.approx(ref, rel=1e-5), (out, ref)


@pytest.mark.slow
def test_fp32_losses_equal_deepspeeds_pipeline_engine(spawn):
    steps = 3
    ds = spawn(_deepspeed, 2, args=(steps,), timeout=600)[0]
    ours = spawn(_ours, 2, args=(steps, False))[0]
    rel = max(abs(a - b) / abs(b) for a, b in zip(ours, ds))
    print(f"llama tiny pp=2 fp32: ours {ours} DeepSpeed {ds} max rel {rel:.2e}")
    assert rel < 1e-5, (ours, ds)
