"""bf16 and fp16 on the llama pipeline against DeepSpeed's pipeline engine, at pp = 2 and at
pp × dp = 2 × 2 (there with fp32 too): per-step losses within 1e-2 relative (fp32 1e-5) and, in
fp16, the same loss-scale schedule (overflow steps skipped on every stage, the scale halved — and
where DeepSpeed 0.19.8's fp16 pipeline leaves the loss unscaled, a test that pins that); Lion
against its formula. DeepSpeed refuses fp16 on this CPU (no native fp16 kernels): its accelerator
check is overridden inside the DeepSpeed test process only."""
import pytest
import torch

from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from pipeline_parallel.engine.config import Lion
from pipeline_parallel.models import llama_layers, llama_loss, llama_model

SEQ, B, M, STEPS = 16, 2, 2, 5


def batch(step, mb):
    g = torch.Generator().manual_seed(1000 * step + mb)
    ids = torch.randint(0, 256, (B, SEQ), generator=g)
    return ids, ids.clone()


def config(dtype, power=24):
    # fp32: no clipping, since DeepSpeed's fp32 pipeline clips by stage 0's norm only (test_pipeline_parity.py)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
           "gradient_clipping": 0.0 if dtype == "fp32" else 1.0}
    if dtype == "fp32":
        return cfg
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:          # 2^24 overflows in fp16 when the loss is scaled; 2^8 does not, and doubles every 2 steps
        cfg["fp16"] = {"enabled": True, "initial_scale_power": power, "loss_scale_window": 2}
    return cfg


def _ours(rank, world, dtype, power=24):
    net = PipelineModule(llama_layers(llama_model("tiny").train()), num_stages=2, loss_fn=llama_loss,
                         partition_method="uniform")
    engine = initialize(model=net, config=config(dtype, power))[0]
    losses, scales, d = [], [], engine.dp_rank          # each data replica reads its own micro-batches
    for t in range(STEPS):
        scales.append(engine.loss_scale)
        losses.append(float(engine.train_batch(iter([batch(t, d * M + i) for i in range(M)]))))
    assert all(p.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
               for p in net.parameters())
    return losses, scales, engine.skipped_steps


def _deepspeed(rank, world, dtype, power=24):
    from parity.zero.sides import prepare_deepspeed   # DeepSpeed: the reference side only
    deepspeed = prepare_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.accelerator import get_accelerator   # deepspeed: optional, the reference
    from deepspeed.pipe import PipelineModule as DSPipelineModule   # deepspeed: optional, the reference
    get_accelerator().is_fp16_supported = lambda: True      # this CPU has no native fp16: DeepSpeed refuses it
    net = DSPipelineModule(layers=llama_layers(llama_model("tiny").train()), num_stages=2, loss_fn=llama_loss,
                           partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                      config=config(dtype, power))
    losses, scales, d = [], [], engine.grid.data_parallel_id
    for t in range(STEPS):
        scales.append(float(engine.optimizer.loss_scale_config.cur_scale) if dtype == "fp16" else 1.0)
        losses.append(float(engine.train_batch(data_iter=iter([batch(t, d * M + i) for i in range(M)]))))
    return losses, scales, engine.skipped_steps


def _many(rank, world, side, dtypes, power):
    """One side's runs for several dtypes in the same processes (one spawn: 4 ranks start slowly here)."""
    return [side(rank, world, dtype, power) for dtype in dtypes]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_losses_and_loss_scale_equal_deepspeeds(spawn, dtype):
    ds = spawn(_deepspeed, 2, args=(dtype, 8), timeout=600)[0]
    ours = spawn(_ours, 2, args=(dtype, 8))[0]
    print(f"{dtype}: ours {ours}\n      DeepSpeed {ds}")
    rel = max(abs(a - b) / abs(b) for a, b in zip(ours[0], ds[0]))
    assert rel < 1e-2, (ours, ds)
    assert ours[1] == ds[1] and ours[2] == ds[2]
    if dtype == "fp16":
        assert ds[1] == [256.0, 256.0, 256.0, 512.0, 512.0]        # the window doubling, on both


@pytest.mark.slow
def test_pp2_dp2_losses_and_loss_scale_equal_deepspeeds(spawn):
    """pp × dp = 2 × 2 (data fastest in both topologies, each replica its own micro-batches): fp32
    per-step losses within 1e-5 of DeepSpeed's pipeline engine (reduction order only); bf16 and fp16
    within 1e-2 (16-bit rounding in different places), fp16 with the same loss-scale schedule."""
    dtypes = ["fp32", "bf16", "fp16"]
    # 4 ranks on 2 cores start slowly: a rendezvous deadline above the default 30 s
    ds = spawn(_many, 4, args=(_deepspeed, dtypes, 8), timeout=1500, comm_timeout=180.0)
    ours = spawn(_many, 4, args=(_ours, dtypes, 8), timeout=900, comm_timeout=180.0)
    for rank in range(4):
        for dtype, o, d in zip(dtypes, ours[rank], ds[rank]):
            print(f"rank {rank} {dtype}: ours {o}\n      DeepSpeed {d}")
            rel = max(abs(a - b) / abs(b) for a, b in zip(o[0], d[0]))
            assert rel < (1e-5 if dtype == "fp32" else 1e-2), (rank, dtype, o, d)
            assert o[1] == d[1] and o[2] == d[2], (rank, dtype, o, d)
    assert ds[0][2][1] == [256.0, 256.0, 256.0, 512.0, 512.0]


@pytest.mark.slow
def test_deepspeed_0_19_8_does_not_scale_the_loss_in_its_fp16_pipeline(spawn):
    """DeepSpeed's engine.backward scales the loss only `if isinstance(self.optimizer, ZeROOptimizer)`
    (runtime/engine.py, backward); FP16_UnfusedOptimizer is not one, so without ZeRO its pipeline
    backpropagates the unscaled loss while step() still divides by the scale: at 2^24 it never
    overflows (and its Adam steps shrink by 2^24 against eps). Ours scales, overflows, skips and halves."""
    ds = spawn(_deepspeed, 2, args=("fp16", 24), timeout=600)[0]
    ours = spawn(_ours, 2, args=("fp16", 24))[0]
    print(f"2^24: ours skipped {ours[2]} scales {ours[1]}; DeepSpeed skipped {ds[2]} scales {ds[1]}")
    assert ds[2] == 0 and ds[1][-1] > 2.0 ** 24 and ours[2] >= 1


@pytest.mark.slow
def test_fp16_overflow_skips_on_every_stage(spawn):
    out = spawn(_ours, 2, args=("fp16",))
    (l0, s0, k0), (l1, s1, k1) = out
    assert s0 == s1 and k0 == k1 >= 1 and l0 == l1
    assert s0[0] == 2.0 ** 24 and all(b in (a / 2, a, a * 2) for a, b in zip(s0, s0[1:]))


def test_lion_matches_its_formula():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    want, m = p.detach().clone(), torch.zeros(7)
    for _ in range(3):
        g = torch.randn(7)
        p.grad = g.clone()
        opt.step()
        want = want * (1 - 0.1 * 0.5) - 0.1 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-7)
