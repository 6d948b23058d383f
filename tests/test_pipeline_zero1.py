"""ZeRO stage 1 over the data axis of a pp = 2 × dp = 2 llama pipeline: equal to stage 0 (the
flat shard runs the same elementwise AdamW), offload_optimizer cpu equal to no offload bit for
bit, in fp32 and bf16; the optimizer state is 1/dp of the stage's; resume from a ZeRO-1
checkpoint continues bit for bit; the dp bytes of a step equal DeepSpeed's stage-1 formula
(reduce-scatter + all-gather, (dp−1)/dp·Ψ each) and stage 0's all-reduce."""
import pytest
import torch

from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.models import llama_layers, llama_loss, llama_model

SEQ, B, M, STEPS = 16, 2, 2, 3


def batch(step, mb):
    g = torch.Generator().manual_seed(1000 * step + mb)
    ids = torch.randint(0, 256, (B, SEQ), generator=g)
    return ids, ids.clone()


def config(stage, offload, bf16):
    z = {"stage": stage}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "zero_optimization": z,
            "bf16": {"enabled": bf16}, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}


def _engine(stage, offload, bf16, seed=0):
    net = PipelineModule(llama_layers(llama_model("tiny", seed=seed).train()), num_stages=2, loss_fn=llama_loss,
                         partition_method="uniform")
    return initialize(model=net, config=config(stage, offload, bf16))[0]


def _steps(engine, ts):
    d = engine.dp_rank
    return [float(engine.train_batch(iter([batch(t, d * M + i) for i in range(M)]))) for t in ts]


def _runs(rank, world, path):
    out = {}
    for stage, offload, bf16 in [(0, False, False), (1, False, False), (1, True, False), (1, False, True),
                                 (1, True, True)]:
        e = _engine(stage, offload, bf16)
        losses = _steps(e, range(STEPS))
        state = sum(t.numel() for s in e.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
        out[(stage, offload, bf16)] = (losses, state, sum(p.numel() for p in e.params),
                                       [p.detach().clone() for p in e.params], e.step_bytes["dp"])
    e = _engine(1, True, False)
    _steps(e, range(2))
    e.save_checkpoint(path)
    straight = _steps(e, range(2, 4))
    fresh = _engine(1, True, False, seed=5)
    fresh.load_checkpoint(path)
    out["resume"] = (straight, _steps(fresh, range(2, 4)))
    return out


@pytest.mark.slow
def test_zero1_equals_stage0_and_offload_equals_no_offload(spawn, tmp_path):
    res = spawn(_runs, 4, args=(str(tmp_path),), timeout=600)
    for rank, out in enumerate(res):
        z0, z1, z1o, b1, b1o = (out[k] for k in [(0, False, False), (1, False, False), (1, True, False),
                                                  (1, False, True), (1, True, True)])
        assert z1o[0] == z1[0] and all(torch.equal(a, b) for a, b in zip(z1o[3], z1[3]))   # offload: bit for bit
        assert b1o[0] == b1[0] and all(torch.equal(a, b) for a, b in zip(b1o[3], b1[3]))
        assert z1[0] == pytest.approx(z0[0], rel=1e-6)                                     # ZeRO-1 = stage 0
        for a, b in zip(z1[3], z0[3]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert z0[1] == 2 * z0[2] and z1[1] == 2 * (-(-z1[2] // 2))  # Adam m + v: 2·Ψ_s vs 2·Ψ_s/dp (padded)
        # dp traffic of a step (the ledger): ZeRO-1 reduce-scatters the gradients and all-gathers the
        # updated parameters, (dp−1)/dp·Ψ_pad each (DeepSpeed's stage 1); stage 0's all-reduce moves
        # 2(dp−1)/dp·Ψ — the same total, where an all-reduce + all-gather would move 1.5× it
        pad = -(-z1[2] // 2) * 2
        assert z0[4] == 2 * (2 - 1) / 2 * z0[2] * 4, (rank, z0[4], z0[2])
        for run, width in ((z1, 4), (z1o, 4), (b1, 2), (b1o, 2)):
            assert run[4] == (2 - 1) / 2 * pad * (width + width), (rank, run[4], pad, width)
        straight, resumed = out["resume"]
        assert straight == resumed, (rank, straight, resumed)
