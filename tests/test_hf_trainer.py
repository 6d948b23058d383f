"""recipes/hf_trainer.py (the Hugging Face Trainer with TrainingArguments(deepspeed=...)) on 2 ranks:
the real DeepSpeed vs ringzero's runner: per-step losses, resume_from_checkpoint on both engines,
the held-out predictions after training.

    python -m pytest -q -m slow tests/test_hf_trainer.py        (~10 min on 2 cores when idle)
    python -m clients.compare --case hf-trainer-fp32-zero2 --per-step   (the same runs, printed side by side)

Each case is a clients/compare.py case: on each side `torchrun --nproc_per_node 2 clients/run.py SIDE
recipes/hf_trainer.py --stage S --steps 6 --save-every 3`, then the same with `--resume-from
checkpoint-3` (SIDE deepspeed = the installed DeepSpeed 0.19.8, ringzero = -m zero_from_scratch.as_deepspeed;
the same start-up seed). Tolerances, fp32:
- losses, DeepSpeed vs ringzero: 1e-5 relative. The two engines add the ranks' gradients in their own
  order (DeepSpeed's all-reduce / reduce-scatter buckets vs ours), so the parameters may differ in the
  last bits after a step; measured ≤ ~1e-7 relative (one fp32 ulp of the loss), 1e-5 leaves ~100×.
- resumed vs uninterrupted, on each engine: equal bit for bit. Same process count, same kernels, the
  checkpoint holds the fp32 parameters and Adam states exactly, and the Trainer restores its RNG and
  skips the batches it has seen; any difference is a state the checkpoint lost.
- held-out logits: the same predicted label on all 64 snippets and within clients.compare.LOGIT_TOL
  (1e-5 absolute) of each other: the parameters' last-bit differences reach the logits through six
  encoder layers (measured 6e-8 at ZeRO-1), 1e-5 leaves > 100×.
The trace tests: clients/trace.py counts only a client's calls (default suite, < 1 s), and the Trainer
makes the same DeepSpeed calls on both engines (slow).
"""
import re
import types

import pytest
import torch

from clients import trace
from clients.compare import LOGIT_TOL, compare
from primitives.launch import free_port
from tests.conftest import run_cmd


def _check_parity(c: dict) -> None:
    assert c["same_steps"] and c["steps"] >= 5, c["deepspeed"]
    assert c["losses_within"], (f"step {c['worst_step'] + 1}: deepspeed {c['deepspeed']} vs ringzero "
                                f"{c['ringzero']} (max rel {c['max_rel']:.2e})")
    lg = c["logits"]
    assert lg is not None and lg["n"] == 64, "recipes/hf_trainer.py printed no LOGITS line"
    assert lg["same_argmax"] == lg["n"], lg
    assert lg["max_abs"] <= LOGIT_TOL, lg


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_equals_real_deepspeed_and_resumes_on_both(stage):
    """resume_from_checkpoint: the Trainer saves through engine.save_checkpoint, loads with
    load_checkpoint(load_module_strict=...), restores its RNG and skips the batches it has seen; its log
    history brings steps 1-3 back from trainer_state.json, steps 4-6 are trained again."""
    c = compare(f"hf-trainer-fp32-zero{stage}")
    _check_parity(c)
    for side, r in c["runs"].items():
        assert len(r["first"]) == len(r["losses"]) == 6, (side, r["first"], r["losses"])
        assert r["losses"][3:] == r["first"][3:], f"{side}: resumed {r['losses']} vs uninterrupted {r['first']}"


@pytest.mark.slow
@pytest.mark.deepspeed
def test_trainer_with_accumulation_equals_real_deepspeed():
    """accumulation 2: the Trainer marks the boundary itself (set_gradient_accumulation_boundary) and calls
    backward(loss, scale_wrt_gas=False) on a loss it has already divided by the accumulation."""
    _check_parity(compare("hf-trainer-fp32-zero2-accum2"))


TRACE_ARGS = "recipes/hf_trainer.py --stage 3 --grad-accum 2 --steps 1 --n-train 8 --n-eval 8 --batch 2"


def _calls(out: str) -> list[tuple[str, str]]:
    return re.findall(r"^│ (\S.*?)\s+│\s+(\d+) │$", out, re.M)


def test_trace_counts_the_clients_calls_only():
    """clients/trace.py: the engine's calls to itself (step() asking is_boundary(), a hook in the engine's
    package calling it) are not the client's;
    a bool keyword's value is part of the call (is_boundary=True and False are two rows)."""
    class Engine(torch.nn.Module):
        def step(self):
            return self.is_boundary()

        def is_boundary(self):
            return True

        def set_boundary(self, is_boundary):
            return is_boundary

        def forward(self, x):
            return x

    fake = types.SimpleNamespace(initialize=lambda model, config=None: (Engine(), None, None, None),
                                 init_distributed=lambda: None,
                                 zero=types.SimpleNamespace(Init=lambda: None, GatheredParameters=lambda p: None))
    trace._counts.clear()
    trace.install(fake, report_at_exit=False)
    engine, *_ = fake.initialize(model=None, config={})
    for boundary in (False, True, False, True):
        engine.set_boundary(is_boundary=boundary)
    engine(torch.ones(1))
    engine.step()
    hook = {"__name__": "deepspeed.runtime.engine"}   # a function of the engine's package, as its forward hooks are
    exec("def hook(e):\n    return e.is_boundary()", hook)
    hook["hook"](engine)
    assert isinstance(engine, Engine)
    assert trace._counts == {"deepspeed.initialize(model=None, config=)": 1, "engine.set_boundary(is_boundary=False)": 2,
                             "engine.set_boundary(is_boundary=True)": 2, "engine.forward(_)": 1, "engine.step()": 1}
    trace._counts.clear()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_trainer_makes_the_same_deepspeed_calls_on_both(tmp_path):
    """The Trainer (through accelerate) calls the same DeepSpeed API, with the same arguments, whichever
    `deepspeed` answers: CLIENT_TRACE=1 counts them on each side (ZeRO-3, 2 micro-batches per step)."""
    calls = {}
    for side in ("deepspeed", "ringzero"):
        r = run_cmd(f"torchrun --nproc_per_node 2 --master_port {free_port()} clients/run.py {side} {TRACE_ARGS} "
                    f"--output-dir {tmp_path}/{side}", timeout=600, env={"CLIENT_TRACE": "1"})
        calls[side] = _calls(r.stdout)
    assert ("engine.set_gradient_accumulation_boundary(is_boundary=False)", "1") in calls["ringzero"], calls
    assert ("engine.backward(_, scale_wrt_gas=False)", "2") in calls["ringzero"], calls
    assert calls["deepspeed"] == calls["ringzero"]
