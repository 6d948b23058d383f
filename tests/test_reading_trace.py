"""The functions READING.md names are the ones that run: traced on the default paths, 2 ranks.

    python -m pytest -q tests/test_reading_trace.py

Each scenario is what a user calls through the public API, passing no algorithm and no option:
    DDP step                  ddp_examples.BucketedDataParallel(model) + forward / backward / SGD step
    1F1B step                 pipeline_parallel.initialize(PipelineModule over 2 stages) + train_batch
                              (no "pipeline" section: the default schedule)
    column-parallel forward   tensor_parallel.parallelize(an MLP stack) + forward / backward
On every rank one profile hook (`sys.setprofile`, and `threading.setprofile` for the threads the
engine starts) records the code object of every Python call while the scenario runs; the test
asserts that the code object of each function SCENARIOS names ran on every rank: the textbook
function itself, not an engine override of the same name. Each scenario also checks its result
against one process, so a path that skips the work fails too. The collectives' default path is
tests/test_trace_collectives.py's, ZeRO's tests/test_reading_trace_zero.py's.
Cost: one 2-rank spawn, a few seconds.
"""
import copy
import importlib
import inspect
import sys
import threading

import pytest
import torch
import torch.nn as nn

from benchmarks import textbook as T

# scenario → (READING.md idea, the function of its entry that must run: the entry itself, or for a
# Class entry the method named here)
SCENARIOS = {
    "DDP step": [("bucketed DDP", "BucketedDataParallel._on_grad")],
    "1F1B step": [("stage split", "balanced"), ("pipeline instruction", "fwd_ops"), ("1F1B", "one_f_one_b"),
                  ("pipeline executor", "Executor.run"), ("executor forward", "Executor.fwd"),
                  ("executor backward", "Executor.bwd")],
    "column-parallel forward": [("f (copy to tp)", "CopyToTP.forward"), ("f (copy to tp)", "CopyToTP.backward"),
                                ("column parallel", "ColumnParallelLinear.forward"),
                                ("row parallel", "RowParallelLinear.forward"),
                                ("g (reduce from tp)", "ReduceFromTP.forward")],
}


def _code(path: str, name: str):
    """The code object of function/Class.method `name` as textbook file `path` defines it (decorators unwrapped)."""
    obj = importlib.import_module(T.module_of(path))
    for part in name.split("."):
        obj = vars(obj)[part] if isinstance(obj, type) else getattr(obj, part)   # the class's own, not inherited
    return inspect.unwrap(getattr(obj, "__func__", obj)).__code__                 # __func__: a staticmethod's


def _sgd_reference(model: nn.Module, batches: list, lr: float) -> nn.Module:
    """One process: one SGD step on the mean loss over `batches` (equal-sized), on a copy of `model`."""
    one = copy.deepcopy(model)
    for x, y in batches:
        (nn.functional.cross_entropy(one(x), y) / len(batches)).backward()
    torch.optim.SGD(one.parameters(), lr=lr).step()
    return one


def _ddp_step(rank, world):
    import ddp_examples
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(world)]
    want = _sgd_reference(model, batches, 0.1)
    dp = ddp_examples.BucketedDataParallel(model)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    nn.functional.cross_entropy(dp(batches[rank][0]), batches[rank][1]).backward()
    opt.step()
    for p, q in zip(model.parameters(), want.parameters()):
        torch.testing.assert_close(p, q)      # float32 summed in another order: the default tolerances


def _one_f_one_b_step(rank, world):
    import pipeline_parallel
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 8, generator=g), torch.randint(0, 4, (2,), generator=g)) for _ in range(4)]
    want = _sgd_reference(nn.Sequential(*layers), batches, 0.1)
    with torch.no_grad():
        want_loss = sum(float(nn.functional.cross_entropy(nn.Sequential(*layers)(x), y)) for x, y in batches) / 4
    pm = pipeline_parallel.PipelineModule(layers, num_stages=2, loss_fn=nn.functional.cross_entropy)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = pipeline_parallel.initialize(model=pm, config=cfg)[0]
    loss = engine.train_batch(iter(batches))
    torch.testing.assert_close(loss.item(), want_loss)
    lo, hi = pm.parts[rank], pm.parts[rank + 1]               # this rank's stage: its layers, trained in place
    for layer, ref in zip(layers[lo:hi], list(want)[lo:hi]):
        for p, q in zip(layer.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)


def _column_parallel_forward(rank, world):
    import tensor_parallel
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 4))
    model = tensor_parallel.parallelize(copy.deepcopy(full))
    x = torch.randn(3, 8)
    xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, want = model(xs[0]), full(xs[1])
    torch.testing.assert_close(y, want)
    y.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad)        # f's backward: the all-reduce of the partial grads
    lo, hi = model[0].bounds
    torch.testing.assert_close(model[0].weight.grad, full[0].weight.grad[lo:hi])


RUNS = {"DDP step": _ddp_step, "1F1B step": _one_f_one_b_step, "column-parallel forward": _column_parallel_forward}


def _traced(rank, world):
    """{scenario: [the named functions that did not run on this rank]}. The hook is set once, before
    any scenario starts a thread, so every thread the engine starts is traced."""
    entries, calls, current = {e.idea: e for e in T.reading_entries()}, {name: set() for name in RUNS}, [None]

    def hook(frame, event, arg):
        if event == "call" and current[0] is not None:
            calls[current[0]].add(frame.f_code)

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        for name, fn in RUNS.items():
            current[0] = name
            fn(rank, world)
            current[0] = None
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {name: [f"{idea} ({entries[idea].path}::{fn})" for idea, fn in want
                   if _code(entries[idea].path, fn) not in calls[name]] for name, want in SCENARIOS.items()}


@pytest.fixture(scope="module")
def traces():
    from primitives.launch import spawn
    return spawn(_traced, 2, timeout=180.0)


def test_every_scenario_names_a_reading_entry():
    """Each named function is its READING.md entry (a function or Class.method entry) or a method of a Class entry."""
    entries = {e.idea: e for e in T.reading_entries()}
    bad = []
    for scenario, want in SCENARIOS.items():
        for idea, fn in want:
            e = entries.get(idea)
            if e is None:
                bad.append(f"{scenario}: READING.md has no idea {idea!r}")
            elif not (fn == e.name or ("." not in e.name and fn.startswith(e.name + "."))):
                bad.append(f"{scenario}: {fn} is not READING.md's {idea!r} entry ({e.name})")
            elif T.node(e.path, fn) is None:
                bad.append(f"{scenario}: {e.path} defines no {fn}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reading_functions_run_on_the_default_path(traces, scenario):
    bad = [f"rank {r}: {miss} did not run" for r, tr in enumerate(traces) for miss in tr[scenario]]
    assert not bad, f"{scenario}:\n  " + "\n  ".join(bad)
