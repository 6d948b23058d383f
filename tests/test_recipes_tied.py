"""Tied / shared parameters under ZeRO (issue 13, item 2).

    python -m pytest -q tests/test_recipes_tied.py          (+ -m slow: stages 1 and 2 vs DeepSpeed)

* A tiny T5ForConditionalGeneration (`shared` held by encoder, decoder and LM head) and a tiny
  GPT-2 LM (lm_head.weight is wte.weight), built from config, vs real DeepSpeed step by step in
  lockstep: loss, grad norm and lr every step, max |Δparam| after every step, final parameters
  (parity.zero.compare.Tolerance.for_run, fp32: 1e-5 relative). T5 ZeRO-3 by default; GPT-2 and 1-2 `slow`.
* A parameter used outside the forward of any module that holds it: without registration every
  rank raises ZeroExternalParameterError naming it; registered (our call, or DeepSpeed's
  `_external_params` dict) the run equals a single-process torch AdamW run.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")

import zero_from_scratch  # noqa: E402
from zero_from_scratch.engine.models import Output  # noqa: E402


def _parity(stages, kinds=("t5", "gpt2")):
    from recipes.tiny import batches
    from parity.zero.harness import Job
    from parity.zero.ds_parity import make_config, run_parities
    pairs, labels = [], []
    for kind in kinds:
        m = f"recipes.tiny:tiny_{kind}"
        for s in stages:
            pairs.append((Job("deepspeed", m, make_config(s, clip=0.5), 4), Job("ours", m, make_config(s, clip=0.5), 4)))
            labels.append(f"{kind} ZeRO-{s}")
    bs = {(f"recipes.tiny:tiny_{k}", 4): batches(k, 8, 8) for k in ("t5", "gpt2")}
    res = run_parities(pairs, 2, batches=bs, timeout=600, lockstep=True)
    bad = [f"{lab}: " + "; ".join(r.failures) for lab, r in zip(labels, res) if not r.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.deepspeed
def test_tied_t5_zero3_matches_deepspeed():
    pytest.importorskip("deepspeed")
    _parity((3,), ("t5",))


@pytest.mark.deepspeed
@pytest.mark.slow
def test_tied_t5_and_gpt2_other_stages_match_deepspeed():
    pytest.importorskip("deepspeed")
    _parity((1, 2))
    _parity((3,), ("gpt2",))


class Outside(nn.Module):
    """`a.weight` is used twice: inside a's forward and by F.linear in the parent's forward."""

    def __init__(self, register: str = ""):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)
        if register == "deepspeed_dict":     # what deepspeed.zero.register_external_parameter writes
            self._external_params = {id(self.a.weight): self.a.weight}

    def forward(self, x, labels):
        h = torch.tanh(self.a(x))
        h = F.linear(h, self.a.weight)
        return Output(F.cross_entropy(self.b(h), labels))


# textbook stage 3 (DeepSpeed's defaults would keep this tiny model's weights gathered all step,
# so an unregistered use would find them and the error below could not show)
CFG = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 9,
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def _data(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _run_outside(rank, world, register):
    torch.manual_seed(0)
    model = Outside(register)
    engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    if register == "ours":
        zero_from_scratch.register_external_parameter(model, model.a.weight)   # after initialize
    for step in range(3):
        x, y = _data(step, rank)
        engine.backward(engine(x=x, labels=y).loss)
        engine.step()
    with engine.gathered_parameters(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("register", ["ours", "deepspeed_dict"])
def test_registered_external_parameter_matches_single_process(spawn, register):
    res = spawn(_run_outside, 2, args=(register,))
    torch.manual_seed(0)
    ref = Outside()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(3):
        opt.zero_grad()
        for r in range(2):
            x, y = _data(step, r)
            (ref(x, y).loss / 2).backward()
        opt.step()
    for r, final in enumerate(res):
        for n, p in ref.named_parameters():
            # fp32, N = 2: the sum over ranks is one addition either way; only Adam's rounding order
            assert torch.allclose(final[n], p.detach(), atol=1e-6, rtol=0), f"rank {r}: {n}"


def test_unregistered_external_parameter_is_a_clear_error_on_every_rank(spawn):
    res = spawn(_run_outside, 2, args=("",), allow_fail=True)
    for r, (status, value) in enumerate(res):
        assert status == "error", f"rank {r}: {status}"
        assert "ZeroExternalParameterError" in value and f"rank {r}: ZeRO-3 parameter 'a.weight'" in value, value
        assert "register_external_parameter" in value
