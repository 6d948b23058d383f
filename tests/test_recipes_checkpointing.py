"""Activation checkpointing under every ZeRO stage (issue 13, item 4).

    python -m pytest -q tests/test_recipes_checkpointing.py

On vs off, same data, two ranks, tiny DistilBERT (dropout 0): the losses, gradient norms and final
parameters are bit-identical at stages 0-3 (recomputing a deterministic CPU forward gives the same
bits, so any difference is a bug, e.g. a recompute that ran on empty ZeRO-3 parameters). At stage 3
the recompute re-gathers: the forward all-gathers per step grow by the checkpointed layers'.
Both switches are covered: the config's section and HF's gradient_checkpointing_enable().
"""
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import zero_from_scratch  # noqa: E402
from zero_from_scratch.engine.activation_checkpointing import ActivationCheckpointingError, apply  # noqa: E402
from zero_from_scratch.engine.models import TinyMLP, tiny_distilbert  # noqa: E402


def _cfg(stage, ac):
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
         "gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
         # textbook stage 3: nothing persists, so recomputation has to gather again (what we count)
         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    if ac == "config":
        c["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False}
    return c


def _run(rank, world, stage, ac):
    torch.manual_seed(0)
    model = tiny_distilbert()
    if ac == "hf":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable()
    engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(stage, ac))
    if ac != "off":
        assert model.is_gradient_checkpointing
    g = torch.Generator().manual_seed(rank)
    rec = []
    for _ in range(3):
        for _ in range(2):
            ids = torch.randint(1, 101, (2, 12), generator=g)
            loss = engine(input_ids=ids, labels=torch.randint(0, 2, (2,), generator=g)).loss
            engine.backward(loss)
            engine.step()
            rec.append(loss.item())
        rec.append(engine.get_global_grad_norm())
    gathers = sum(u.calls for k, u in engine.comm.last_step.items() if k.startswith("param all-gather (forward"))
    with engine.gathered_parameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return rec, params, gathers


def _all(rank, world, stages):
    runs = {(s, ac): _run(rank, world, s, ac) for s in stages for ac in ("off", "config")}
    if 3 in stages:
        runs[3, "hf"] = _run(rank, world, 3, "hf")
    return runs


@pytest.mark.parametrize("stages", [(3,), pytest.param((0, 1, 2), marks=pytest.mark.slow)])
def test_checkpointing_on_equals_off_at_every_stage(spawn, stages):
    res = spawn(_all, 2, args=(stages,), timeout=600.0)
    for r, runs in enumerate(res):
        for s in stages:
            off = runs[s, "off"]
            for ac in ("config", "hf") if s == 3 else ("config",):
                on = runs[s, ac]
                assert on[0] == off[0], f"rank {r} ZeRO-{s} {ac}: losses/norms differ {on[0]} vs {off[0]}"
                assert all(torch.equal(on[1][n], off[1][n]) for n in off[1]), f"rank {r} ZeRO-{s} {ac}: params"
        if 3 in stages:   # ZeRO-3: each checkpointed layer's forward runs twice, and so does its all-gather
            assert runs[3, "config"][2] > runs[3, "off"][2] > 0


def test_model_without_support_is_a_clear_error():
    from transformers import PreTrainedModel

    class NoCkpt(PreTrainedModel):
        supports_gradient_checkpointing = False

    m = NoCkpt.__new__(NoCkpt)
    torch.nn.Module.__init__(m)
    with pytest.raises(ActivationCheckpointingError, match="rank 1: .*NoCkpt does not support activation checkpointing"):
        apply(m, {}, rank=1)
    with pytest.warns(UserWarning, match="not a Hugging Face model"):
        assert apply(TinyMLP(), {}) == "manual"
    with pytest.raises(ValueError, match="activation_checkpointing.bogus"):
        from zero_from_scratch.engine.activation_checkpointing import parse
        parse({"activation_checkpointing": {"bogus": 1}})
