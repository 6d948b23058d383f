"""ZeRO-3 parameters saved for backward as DeepSpeed saves them: an LM head whose fused log-probability
kernel reads `lm_head.weight` in `GatheredParameters`, saves it, and gathers it again in its backward
(TRL's SFT / DPO trainers do this by default; tests/hf_suites/fused_head.py).

    python -m pytest -q tests/test_hf_fused_head.py                 (ringzero against one process, ~10 s)
    python -m pytest -q -m slow tests/test_hf_fused_head.py         (real DeepSpeed 0.19.8 against ringzero)

Tolerances, fp32, 2 ranks, 4 Adam steps: against the one-process reference (the ranks' mean gradient,
torch's Adam) 1e-6 relative: the same kernels run on the same data; the reference adds the two ranks'
gradients in autograd's order, the engine in its reduce-scatter's (last-bit differences, ~1e-7 after
4 steps; measured equal here). Against real DeepSpeed 1e-5 relative (the issue's bound; measured equal bit for bit).
"""
import contextlib

import pytest
import torch

from primitives.launch import spawn
from tests.hf_suites import fused_head
from zero_from_scratch.engine.saved import SavedByReference


def _rank(rank, world, engine, kernel, persist=0):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed(engine)
    ds.init_distributed(dist_backend="gloo")
    return fused_head.train(ds, kernel=kernel, persist=persist)


def _close(a, b, rel):
    return all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


class _Saves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        _Saves.seen = w
        return g * w, None


def test_suspended_hooks_save_the_parameter_object_itself():
    """Through saved-tensor hooks autograd hands back a new tensor (no ds_status, the data of the moment
    of unpacking); inside `suspended` the Parameter itself, as DeepSpeed (no hooks) gets it."""
    p, x = torch.nn.Parameter(torch.ones(3)), torch.ones(3, requires_grad=True)
    saved = SavedByReference(stage=None)
    for inside, expect in ((False, False), (True, True)):
        with saved.active():
            with saved.suspended() if inside else contextlib.nullcontext():
                y = _Saves.apply(x, p)
            assert torch._C._autograd._top_saved_tensors_default_hooks(False)[0] == saved.pack   # restored
        y.sum().backward()
        assert (_Saves.seen is p) is expect


@pytest.mark.parametrize("persist", [0, 100_000])
def test_fused_head_under_ringzero_equals_one_process(persist):
    """persist 0: the kernel gathers the head in forward and again in backward; DeepSpeed's default 1e5:
    the head stays gathered after the first step, so the kernel saves the Parameter outside any gather
    and must get it back (with ds_status) in backward."""
    ours = spawn(_rank, 2, args=("ringzero", "ours", persist), timeout=300.0, comm_timeout=120.0)
    ref = fused_head.reference()
    for r in range(2):
        assert _close(ours[r], ref[r], 1e-6), (r, ours[r], ref[r])


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("kernel", ["ours", "trl"])
@pytest.mark.parametrize("persist", [0, 100_000])
def test_fused_head_under_ringzero_equals_real_deepspeed(kernel, persist):
    """kernel "trl": TRL's own add_fused_lm_head on a tiny Llama (TRL's gather reads HfDeepSpeedConfig)."""
    if kernel == "trl":
        pytest.importorskip("trl")
    ds = spawn(_rank, 2, args=("deepspeed", kernel, persist), timeout=600.0, comm_timeout=300.0)
    ours = spawn(_rank, 2, args=("ringzero", kernel, persist), timeout=300.0, comm_timeout=120.0)
    for r in range(2):
        assert len(ds[r]) == 4 and _close(ours[r], ds[r], 1e-5), (r, ours[r], ds[r])
