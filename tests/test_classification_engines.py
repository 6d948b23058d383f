"""classification/engines.py: the three engines train the same run from the same config, with
DeepSpeed's defaults where the JSON is silent (gradient_clipping absent = clip at 1.0), and label
their precision as built."""
import pytest
import torch

pytestmark = pytest.mark.deepspeed
STEPS, MICRO = 4, 4
RAW = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 9,     # no gradient_clipping key
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "zero_optimization": {"stage": 2}}


def _train(rank, world, kind, raw):
    import primitives.launch  # noqa: F401  (the spawned rank's process group is already up)
    from classification.engines import build
    from zero_from_scratch.engine.models import TinyMLP
    torch.manual_seed(0)
    model = TinyMLP()
    engine = build(kind, model, dict(raw, train_batch_size=MICRO * world))
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(STEPS):
        x = 30 * torch.randn(MICRO * world, 13, generator=g)          # large inputs: gradient norm well above 1
        y = torch.randint(0, 3, (MICRO * world,), generator=g)
        loss = engine(x=x[rank * MICRO:(rank + 1) * MICRO], labels=y[rank * MICRO:(rank + 1) * MICRO]).loss
        engine.backward(loss)
        norms.append(float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                                               if p.grad is not None and p.grad.numel()])))
                     if kind == "ddp" else 0.0)
        engine.step()
    with engine.full_parameters():
        params = {n: p.detach().clone().tolist() for n, p in engine.module.named_parameters()}
    rows = {r[0]: r[2] for r in engine.describe()}
    return params, norms, rows


def _train_all(rank, world):
    """Every engine in these same processes, one after the other (imports paid once)."""
    return ([_train(rank, world, kind, RAW) for kind in ("deepspeed", "zero", "ddp")]
            + [_train(rank, world, "ddp", dict(RAW, gradient_clipping=0.0))])


def test_without_gradient_clipping_all_three_engines_clip_at_1_and_agree(spawn):
    *three, unclipped = spawn(_train_all, 2)[0]
    runs = dict(zip(("deepspeed", "zero", "ddp"), three))
    unclipped = unclipped[0]
    assert min(runs["ddp"][1]) > 1.3                                  # every step's norm: clipping at 1.0 engages
    for kind in ("deepspeed", "zero", "ddp"):
        assert runs[kind][2]["gradient clipping (as built)"] == "1.0", (kind, runs[kind][2])
        assert runs[kind][2]["precision (as built)"] == "fp32", kind
    ref = runs["deepspeed"][0]

    def maxdiff(a):
        return max((torch.tensor(a[n]) - torch.tensor(ref[n])).abs().max().item() for n in ref)
    # fp32, N = 2: reduction order and Adam's arithmetic differ at rounding level (zero_from_scratch.
    # parity.zero.compare.Tolerance: S·lr·4e-4 = 1.6e-5); skipping a clip of a norm ≥ 1.3 changes each update
    assert maxdiff(runs["zero"][0]) < 1.6e-5 and maxdiff(runs["ddp"][0]) < 1.6e-5
    assert maxdiff(unclipped) > 10 * 1.6e-5


def test_fp32_deepspeed_run_is_labelled_fp32():
    """DeepSpeed 0.19.8 names it bfloat16_enabled; asking for bf16_enabled returned a fallback string that
    counted as true, so fp32 runs were labelled bf16."""
    from classification.engines import _flag

    class DS:
        def bfloat16_enabled(self):
            return False
    assert _flag(DS(), "bfloat16_enabled", "bf16_enabled") is False
    assert _flag(object(), "bfloat16_enabled", "bf16_enabled") is False


def test_misspelled_key_is_warned_for_every_engine():
    from classification import config as C
    f = C.RunFacts(world_size=2, steps_per_epoch=10, epochs=1)
    cfg = C.resolve(dict(RAW, gradient_cliping=0.5), f)
    assert any("gradient_cliping (did you mean 'gradient_clipping'?)" in w for w in f.warnings), f.warnings
    assert cfg["gradient_clipping"] == 1.0 and any(r[0] == "gradient_clipping" and r[1] == "(absent)" for r in f.rows)
