"""A ZeRO-1, ZeRO-2 and ZeRO-3 step with defaults runs the textbook's functions for the idea.

    python -m pytest -q tests/test_reading_trace_zero.py

Each scenario is what a user writes: `zero_from_scratch.initialize` with a config that names only
the stage (and an optimizer), then one forward, backward and step. On both ranks `sys.setprofile`
and `threading.setprofile` (overlapped reductions run on a communication thread) record the code
object of every Python call; the test asserts that the code objects of the functions below ran on
every rank. For ZeRO-3 these are the hooks themselves (the closures `Stage3._pre_forward`,
`_post_forward` and `_pre_backward` return), not the factories that register them, so the test
fails if the engine gathers or releases parameters some other way. Cost: one 2-rank spawn, a few
seconds.
"""
import sys
import threading
import types

import pytest
import torch
import torch.nn as nn

from zero_from_scratch import optim, sharding, stage1, stage2, stage3

# READING.md's ZeRO entries (sharding.py::shard_layout, Stage1..3, ShardedAdam.step_group), by
# the functions of each that carry the idea; "Stage3._pre_forward.hook" is the hook it returns.
COMMON = ["sharding.shard_layout", "optim.ShardedAdam.step_group", "stage1.Stage1._sum_into_block",
          "stage1.Stage1.before_backward"]
WANT = {
    1: COMMON + ["stage1.Stage1._make_hook.hook", "stage1.Stage1._reduce", "stage1.Stage1.after_backward",
                 "stage1.Stage1.after_step"],
    2: COMMON + ["stage2.Stage2._make_hook.hook", "stage2.Stage2._reduce", "stage2.Stage2.after_backward",
                 "stage1.Stage1.after_step"],
    3: COMMON + ["stage3.Stage3._pre_forward.hook", "stage3.Stage3._post_forward.hook",
                 "stage3.Stage3._pre_backward.hook", "stage3.Stage3._gather", "stage3.Stage3._release",
                 "stage3.Stage3._reduce", "stage2.Stage2._make_hook.hook", "stage2.Stage2._reduce",
                 "stage3.Stage3.after_backward", "stage3.Stage3.after_step", "stage3.Stage3._make_param_storage"],
}
MODULES = {"sharding": sharding, "optim": optim, "stage1": stage1, "stage2": stage2, "stage3": stage3}


def code_of(name: str) -> types.CodeType:
    """'stage3.Stage3._pre_forward.hook' -> the code object of the closure that method defines."""
    mod, *path = name.split(".")
    obj = MODULES[mod]
    while path and not isinstance(obj, types.CodeType):
        attr = getattr(obj, path[0], None)
        if attr is None:                      # a nested function: look in the enclosing code's constants
            attr = next(c for c in obj.__code__.co_consts
                        if isinstance(c, types.CodeType) and c.co_name == path[0])
        obj = attr
        path = path[1:]
    code = obj if isinstance(obj, types.CodeType) else obj.__code__
    for part in path:
        code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == part)
    return code


class _Trace:
    """Every code object called in this process while active, on every thread."""

    def __init__(self):
        self.codes = set()

    def _hook(self, frame, event, arg):
        if event == "call":
            self.codes.add(frame.f_code)

    def __enter__(self):
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def _steps(rank, world):
    """{stage: [names of WANT[stage] that did not run on this rank]}."""
    import zero_from_scratch
    missing = {}
    for stage in WANT:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": stage}}
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        with _Trace() as tr:
            engine = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
        missing[stage] = [n for n in WANT[stage] if code_of(n) not in tr.codes]
        engine.destroy()                       # its hooks off the model before the next stage
    return missing


@pytest.fixture(scope="module")
def traces():
    from primitives.launch import spawn
    return spawn(_steps, 2, timeout=180.0)


def test_names_resolve_to_code():
    for names in WANT.values():
        for n in names:
            assert isinstance(code_of(n), types.CodeType), n


@pytest.mark.parametrize("stage", list(WANT))
def test_textbook_runs_in_a_default_step(traces, stage):
    bad = {rank: tr[stage] for rank, tr in enumerate(traces) if tr[stage]}
    assert not bad, f"ZeRO-{stage}: textbook functions that did not run, by rank: {bad}"
