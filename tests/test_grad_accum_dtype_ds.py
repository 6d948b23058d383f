"""bf16 with data_types.grad_accum_dtype fp32 at ZeRO stages 1 and 2, against real DeepSpeed 0.19.8.

    python -m pytest -q tests/test_grad_accum_dtype_ds.py

Reference: deepspeed.initialize in the same 2 spawned processes (gloo), same weights and batches,
ACC micro-batches per step, with and without offload_optimizer cpu. SGD (the update is lr · gradient,
so a gradient's rounding shows in the weights, which Adam's g/√v would hide); offload steps Adam
only, so there Adam with eps ≫ √v (update ≈ lr·m/eps, again linear in the gradient). DeepSpeed adds
each micro-batch's bf16 gradient to fp32 buffers (stage 1: BF16_Optimizer's fp32 gradients, or with
offload the fp32 grad_accum, all-reduced as a bf16 copy at the boundary; stage 2: each micro-batch
reduced in bf16, added to an fp32 partition). Both sides do the same roundings in the same order, so
the fp32 master weights may differ only by fp32 rounding of the update (TOL = 1e-6 absolute on
weights of size ~0.3; measured: 0, bit for bit). Accumulating in bf16 instead rounds every partial
sum to 8 bits (relative 2^-9 per add): that moves the weights by 5e-4 to 1.2e-3 (measured, all four
cases), far outside TOL (stage 1 needs ACC ≥ 3: one bf16 add equals fp32 + the bf16 cast DeepSpeed
does). The bf16 weights must be the bf16 rounding of those masters, and the losses equal: exact.
"""
import pytest
import torch
import torch.nn as nn

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

STEPS, MB, ACC, TOL = 2, 4, 4, 1e-6
# offload steps Adam only; eps ≫ √v makes its update ≈ lr·m/eps, linear in the gradient as SGD's
OFFLOAD_ADAM = {"type": "Adam", "params": {"lr": 1.0, "eps": 1.0, "torch_adam": True}}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def _batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MB, 8, generator=g), torch.randn(MB, 4, generator=g)


def _run(side, stage, offload, rank):
    import zero_from_scratch
    from deepspeed.utils import safe_get_full_fp32_param as ds_fp32
    from parity.zero.sides import prepare_deepspeed
    from zero_from_scratch.engine.safe_api import safe_get_full_fp32_param as our_fp32
    m = _model()
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": ACC, "gradient_clipping": 0.0,
           "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu" if offload else "none"}},
           "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
           "optimizer": OFFLOAD_ADAM if offload else {"type": "SGD", "params": {"lr": 1.0}}}
    init = prepare_deepspeed().initialize if side == "deepspeed" else zero_from_scratch.initialize
    engine, *_ = init(model=m, model_parameters=m.parameters(), config=cfg)
    losses = []
    for t in range(STEPS):
        for k in range(ACC):
            x, y = _batch(t, k, rank)
            loss = nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    fp32 = ds_fp32 if side == "deepspeed" else our_fp32
    return losses, [fp32(p).clone() for p in m.parameters()], [p.detach().clone() for p in m.parameters()]


def _both(rank, world):
    import warnings
    warnings.filterwarnings("ignore")
    return {(s, o): (_run("deepspeed", s, o, rank), _run("ours", s, o, rank)) for s in (1, 2) for o in (False, True)}


def test_bf16_fp32_grad_accumulation_equals_deepspeed(spawn):
    for rank_res in spawn(_both, 2):
        for stage, ((ds_l, ds_m, ds_p), (our_l, our_m, our_p)) in rank_res.items():
            worst = max(float((a - b).abs().max()) for a, b in zip(ds_m, our_m))
            print(f"ZeRO-{stage[0]} offload={stage[1]}: fp32 masters max |diff| {worst:.2e}")
            assert worst <= TOL, (stage, worst)
            moved = max(float((a - p.detach().float()).abs().max()) for a, p in zip(ds_m, _model().parameters()))
            assert moved > 100 * TOL, (stage, moved)       # the weights did move: the check has teeth
            for a, b, m in zip(ds_p, our_p, our_m):
                assert a.dtype == b.dtype == torch.bfloat16
                assert torch.equal(b, m.bfloat16()), stage      # the bf16 params are the rounded masters
                assert torch.equal(a, b), stage
            assert ds_l == our_l, (stage, ds_l, our_l)    # same bf16 weights, same batches: same forward
