"""Parity with real DeepSpeed: zero_from_scratch vs deepspeed.initialize, same JSON config.

    python -m pytest -q -m deepspeed tests/test_zero_ds_parity.py

All N = 2 pairs run in ONE spawn (a module fixture), the N = 3 pairs in another, so DeepSpeed's
import and start-up are paid twice. No JIT build happens: "torch_adam": true avoids fused_adam and
sides.prepare_deepspeed() skips the shm comm op (test_deepspeed_ran_without_any_jit_build).
Config: AdamW lr 1e-2, weight decay 0.1 on a decay group and 0 on biases/LayerNorm, clipping 0.5,
WarmupLR, gradient accumulation 2, micro-batch 4 per rank, 5 optimizer steps. Tolerances are
parity.zero.compare.Tolerance.for_run (the reasons are written there).
"""
import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from parity.zero.ds_parity import make_config, run_parities  # noqa: E402
from parity.zero.compare import Tolerance, compare  # noqa: E402
from parity.zero.harness import Job  # noqa: E402

pytestmark = pytest.mark.deepspeed
STEPS = 5


CLIP = {"mlp": 0.5, "distilbert": 0.2}  # below some of each model's gradient norms: clipping engages


def _pairs(model, stages, bf16=False):
    return [(Job("deepspeed", model, make_config(s, bf16=bf16, clip=CLIP[model]), STEPS),
             Job("ours", model, make_config(s, bf16=bf16, clip=CLIP[model]), STEPS)) for s in stages]


def _overlapped(stage, model):
    """overlap_comm on BOTH sides: DeepSpeed's reduction stream / ours' communication thread."""
    cfg = make_config(stage, clip=CLIP[model])
    cfg["zero_optimization"]["overlap_comm"] = True
    return cfg


def _overlap_pairs():
    return [(Job("deepspeed", m, _overlapped(s, m), STEPS), Job("ours", m, _overlapped(s, m), STEPS))
            for m in MODELS for s in STAGES]


def _check(results, labels):
    bad = [f"{lab}:\n  " + "\n  ".join(r.failures) for lab, r in zip(labels, results) if not r.ok]
    assert not bad, "outside tolerance:\n" + "\n".join(bad)


MODELS = ("mlp", "distilbert")
STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Every N = 2 pair (2 models × 3 stages × fp32/bf16 = 12 pairs) in ONE spawn, with an empty
    TORCH_EXTENSIONS_DIR so that any JIT build would show up there."""
    ext = tmp_path_factory.mktemp("torch_extensions")
    pairs = [p for bf16 in (False, True) for m in MODELS for p in _pairs(m, STAGES, bf16)] + _overlap_pairs()
    res = run_parities(pairs, 2, env={"TORCH_EXTENSIONS_DIR": str(ext)}, timeout=600.0)
    keys = [(bf16, m, s) for bf16 in (False, True) for m in MODELS for s in STAGES]
    keys += [("overlap", m, s) for m in MODELS for s in STAGES]
    return dict(zip(keys, res)), ext


@pytest.mark.parametrize("model", MODELS)
def test_fp32_stages_1_2_3_world2(world2, model):
    res, _ = world2
    _check([res[False, model, s] for s in STAGES], [f"{model} ZeRO-{s} fp32" for s in STAGES])
    for s in STAGES:
        rows = res[False, model, s].rows
        # WarmupLR really ramps (min 1e-3 → max 1e-2) and clipping really engages
        assert rows[0]["lr_ours"] == pytest.approx(1e-3) and rows[-1]["lr_ours"] == pytest.approx(1e-2)
        assert any(r["grad_norm_ref"] > CLIP[model] for r in rows), "clipping never engaged: the test would not see it"


@pytest.mark.parametrize("model", MODELS)
def test_bf16_stages_1_2_3_world2(world2, model):
    res, _ = world2
    _check([res[True, model, s] for s in STAGES], [f"{model} ZeRO-{s} bf16" for s in STAGES])


@pytest.mark.parametrize("model", MODELS)
def test_overlap_comm_both_sides_fp32_world2(world2, model):
    """overlap_comm: true in both engines: within tolerance at every stage, and at stages 1-2 EXACTLY
    as close to DeepSpeed as without overlap — the same loss differences at every step and the same
    largest parameter difference, to the bit (same sums of the same buckets, only launched earlier;
    the remaining ~1 ulp, up to 1.2e-7 measured, is there with overlap off too)."""
    res, _ = world2
    _check([res["overlap", model, s] for s in STAGES], [f"{model} ZeRO-{s} fp32 overlap_comm" for s in STAGES])
    for s in (1, 2):
        r, plain = res["overlap", model, s], res[False, model, s]
        assert r.max_param_diff == plain.max_param_diff, (s, r.max_param_diff, plain.max_param_diff)
        assert [row["dloss"] for row in r.rows] == [row["dloss"] for row in plain.rows]
        assert [row["dnorm"] for row in r.rows] == [row["dnorm"] for row in plain.rows]


def test_deepspeed_ran_without_any_jit_build(world2):
    """torch_adam avoids fused_adam; prepare_deepspeed() avoids the shm comm op: nothing compiled."""
    _, ext = world2
    assert list(ext.iterdir()) == [], f"DeepSpeed JIT-built {sorted(p.name for p in ext.iterdir())}"


def test_fp32_mlp_stages_1_2_3_world3_and_weight_decay_bug_is_caught():
    """N = 3: uneven shards and non-commutative three-way sums. The last pair feeds ours a config
    with weight decay 0 against DeepSpeed's 0.1: the harness must flag the parameters, not the
    step-1 loss — proof that the parameter tolerance is tighter than a real bug."""
    pairs = _pairs("mlp", (1, 2, 3))
    no_wd = make_config(2)
    no_wd["optimizer"]["params"]["weight_decay"] = 0.0
    pairs.append((Job("deepspeed", "mlp", make_config(2), STEPS), Job("ours", "mlp", no_wd, STEPS)))
    res = run_parities(pairs, 3)
    _check(res[:3], ["ZeRO-1", "ZeRO-2", "ZeRO-3"])
    bug = res[3]
    assert not bug.ok and any("final parameters" in f for f in bug.failures), bug.failures
    assert bug.max_param_diff > 10 * bug.tol.param_atol
    assert bug.rows[0]["ok"], "step 1 sees the same weights, so its loss must agree"


def test_compare_thresholds_without_processes():
    """compare() itself: a drift inside the tolerance passes, a bug-sized one fails, NaN fails."""
    import torch
    tol = Tolerance.for_run(False, STEPS, 1e-2)
    rec = [{"step": 1, "loss": 1.0, "grad_norm": 2.0, "lr": 1e-3}]
    p = {"w": torch.ones(3)}

    def side(loss=1.0, norm=2.0, w=None):
        return {"records": [{**rec[0], "loss": loss, "grad_norm": norm}], "params": {"w": p["w"] if w is None else w}}

    assert compare(side(), side(loss=1.0 + 1e-6, norm=2.0 * (1 + 1e-6), w=p["w"] + tol.param_atol / 2), tol).ok
    assert not compare(side(), side(loss=1.0 + 1e-3), tol).ok
    assert not compare(side(), side(norm=4.0), tol).ok                      # a missing 1/N
    assert not compare(side(), side(w=p["w"] * (1 - 1e-3)), tol).ok         # one step of lr·wd
    assert not compare(side(), side(w=torch.full((3,), float("nan"))), tol).ok
    with pytest.raises(ValueError, match="param_atol"):
        Tolerance(1e-5, 1e-5, 0.0)


def test_classification_parity_cli_refuses_a_missing_config():
    """parity/distilbert.py's parity run itself is chapter 08's `python -m parity.distilbert --tiny --steps 3`
    (tests/test_tutorials.py runs it under `set -e`; it exits 1 outside tolerance); here its bad input."""
    from conftest import run_cmd
    bad = run_cmd("python -m parity.distilbert --tiny --config no/such.json", timeout=60, check=False)
    assert bad.returncode == 2 and "no/such.json" in bad.stdout and "does not exist" in bad.stdout, bad.stdout
