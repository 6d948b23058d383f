"""Every ZeRO stage equals single-process torch AdamW on the global batch (fp32).

Reference: the same model and initial weights in one process, torch.optim.AdamW(foreach=False)
with the same param groups (weight decay on matrices only), gradients of the mean loss over the
global batch (N ranks × gradient_accumulation micro-batches), torch.nn.utils.clip_grad_norm_.

Tolerance: the only differences are summation order (per-rank gradients summed across ranks
then divided by N, vs one backward over the whole batch; the norm as a sum of shard squares vs
torch's norm of per-tensor norms). Those are fp32 rounding, ~1e-7 relative per step; Adam's
normalisation can amplify a relative error in tiny gradient entries, and 12 steps compound it,
so we allow atol 2e-5 / rtol 1e-4 on weights of size ~0.1 and 1e-5 relative on the losses and norms
— a real bug (missing averaging, wrong clip, a shard not updated) is off by > 1e-2.
"""
import pytest
import torch
import torch.nn as nn

import zero_from_scratch

STEPS, GAS, MICRO, CLIP, LR, WD = 12, 2, 4, 0.5, 2e-2, 0.1


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 13), nn.Tanh(), nn.Linear(13, 3))


def groups(model):
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no = [p for n, p in model.named_parameters() if p.ndim != 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no, "weight_decay": 0.0}]


def data(step, micro, rank, world):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(MICRO, 10, generator=g)
    y = torch.randint(0, 3, (MICRO,), generator=g)
    return x, y


def config(stage, world, bucket=None):
    c = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
         "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": WD}},
         "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if bucket:
        c["zero_optimization"]["reduce_bucket_size"] = bucket
    return c


def _train(rank, world, stage, impl, bucket):
    model = make_mlp()
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=groups(model),
                                              config=config(stage, world, bucket), comm_impl=impl)
    losses, norms = [], []
    for step in range(STEPS):
        for m in range(GAS):
            x, y = data(step, m, rank, world)
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    with engine.gathered_parameters(list(model.parameters())):
        final = {n: p.detach().tolist() for n, p in model.named_parameters()}
    return losses, norms, final, engine.global_steps


def reference(world):
    model = make_mlp()
    opt = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    losses, norms = {r: [] for r in range(world)}, []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(GAS):
            for r in range(world):
                x, y = data(step, m, r, world)
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / (world * GAS)).backward()
                losses[r].append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,world,impl,bucket", [
    (0, 2, "primitives", None), (1, 2, "primitives", None), (1, 3, "primitives", 200),
    (2, 2, "primitives", 200), (2, 3, "torch", None), (3, 2, "primitives", None),
])  # stage 3 at N=3: test_zero_reports / test_zero_stage3
def test_stage_equals_single_process_adamw(spawn, stage, world, impl, bucket):
    results = spawn(_train, world, args=(stage, impl, bucket))
    ref_losses, ref_norms, ref_final = reference(world)
    for r, (losses, norms, final, steps) in enumerate(results):
        assert steps == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[r]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        for n, t in ref_final.items():
            torch.testing.assert_close(torch.tensor(final[n]), t, rtol=1e-4, atol=2e-5, msg=lambda m: f"rank {r} {n}: {m}")
    # clipping was active (the test would not notice a broken clip otherwise)
    assert max(ref_norms) > CLIP
    # and training moved the weights far beyond the tolerance
    assert (ref_final["0.weight"] - make_mlp()[0].weight).abs().max() > 1e-2
