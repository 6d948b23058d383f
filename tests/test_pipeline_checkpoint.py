"""Pipeline checkpoints in DeepSpeed's pipeline layout: the file names DeepSpeed writes, and a resume
that continues bit for bit (losses and weights equal to the run that never stopped), on the
llama layers at pp = 2 with an LR scheduler; DeepSpeed's pipeline engine loads ours (slow)."""
import os

import pytest
import torch

from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.models import llama_layers, llama_loss, llama_model

SEQ, B, M = 16, 2, 2


def batch(step, mb):
    g = torch.Generator().manual_seed(1000 * step + mb)
    ids = torch.randint(0, 256, (B, SEQ), generator=g)
    return ids, ids.clone()


def config(bf16=False):
    return {"bf16": {"enabled": bf16}, "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}},
            "gradient_clipping": 1.0}


def _engine(seed, tied=True, bf16=False):
    net = PipelineModule(llama_layers(llama_model("tiny", seed=seed, tie_word_embeddings=tied).train()),
                         num_stages=2, loss_fn=llama_loss, partition_method="uniform")
    return initialize(model=net, config=config(bf16))[0]


def _steps(engine, ts):
    return [float(engine.train_batch(iter([batch(t, i) for i in range(M)]))) for t in ts]


def _weights(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _resume(rank, world, path, bf16=False):
    engine = _engine(0, bf16=bf16)
    _steps(engine, range(2))
    engine.save_checkpoint(path, client_state={"epoch": 7})
    straight = _steps(engine, range(2, 4))
    fresh = _engine(seed=1, bf16=bf16)                                   # other weights: everything must come from the files
    load_path, client = fresh.load_checkpoint(path)
    resumed = _steps(fresh, range(2, 4))
    same = all(torch.equal(a, b) for a, b in zip(_weights(engine).values(), _weights(fresh).values()))
    return straight, resumed, same, client, fresh.global_steps, os.path.basename(load_path)


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_resume_is_bit_exact_in_deepspeeds_layout(spawn, tmp_path, bf16):
    out = spawn(_resume, 2, args=(str(tmp_path), bf16))      # bf16: the fp32 masters are saved and restored too
    for rank, (straight, resumed, same, client, steps, name) in enumerate(out):
        assert straight == resumed and same, (rank, straight, resumed)
        assert client == {"epoch": 7} and steps == 4 and name == f"mp_rank_{rank:02d}_model_states.pt"
    assert (tmp_path / "latest").read_text() == "global_step2"
    files = sorted(os.listdir(tmp_path / "global_step2"))
    # tiny llama: 0 embedding, 1-4 blocks, 5 norm, 6 head (tied: calls the embedding through forward_fn,
    # so it has no file of its own, as DeepSpeed's forward_funcs holds a partial there)
    assert files == [f"layer_{i:02d}-model_states.pt" for i in range(6)] + \
        ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    sd = torch.load(tmp_path / "global_step2" / "layer_01-model_states.pt")
    assert "layer.self_attn.q_proj.weight" in sd


def _plain_config():
    cfg = config()
    del cfg["scheduler"]
    cfg["gradient_clipping"] = 0.0          # DeepSpeed's fp32 pipeline clips by stage 0's norm only
    return cfg


def _ours_saves(rank, world, path):
    net = PipelineModule(llama_layers(llama_model("tiny", tie_word_embeddings=True).train()), num_stages=2,
                         loss_fn=llama_loss, partition_method="uniform")
    engine = initialize(model=net, config=_plain_config())[0]
    _steps(engine, range(2))
    engine.save_checkpoint(path)
    return _steps(engine, range(2, 4))


def _deepspeed_loads(rank, world, path):
    from parity.zero.sides import prepare_deepspeed   # DeepSpeed: the reference side only
    deepspeed = prepare_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.pipe import PipelineModule as DSPipelineModule   # deepspeed: optional, the reference
    from deepspeed.pipe import TiedLayerSpec as DSTied   # deepspeed: optional, the reference
    layers = [DSTied(s.key, s.typename, *s.module_args, forward_fn=s.forward_fn) if hasattr(s, "key") else s
              for s in llama_layers(llama_model("tiny", seed=1, tie_word_embeddings=True).train())]
    net = DSPipelineModule(layers=layers, num_stages=2, loss_fn=llama_loss, partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()], config=_plain_config())
    engine.load_checkpoint(path)
    return [float(engine.train_batch(data_iter=iter([batch(t, i) for i in range(M)]))) for t in range(2, 4)]


@pytest.mark.slow
def test_deepspeed_resumes_from_our_checkpoint(spawn, tmp_path):
    ours = spawn(_ours_saves, 2, args=(str(tmp_path),))[0]
    ds = spawn(_deepspeed_loads, 2, args=(str(tmp_path),), timeout=600)[0]
    print(f"continued: ours {ours}, DeepSpeed from our files {ds}")
    assert ds == pytest.approx(ours, rel=1e-6)
