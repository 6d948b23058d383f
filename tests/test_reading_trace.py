"""The functions READING.md names are the ones that run: traced on the default path, 2 ranks.

    python -m pytest -q tests/test_reading_trace.py

Each scenario is a call a user makes through the public API, with nothing but defaults:
    all_reduce ring           primitives.all_reduce(t, algorithm="ring")
    ZeRO-3 step               zero_from_scratch.initialize(stage 3) + one forward / backward / step
    1F1B step                 pipeline_parallel.initialize(PipelineModule, schedule "1f1b") + train_batch
    column-parallel forward   tensor_parallel.ColumnParallelLinear(nn.Linear, primitives.get_comm()) forward
On every rank `sys.setprofile` and `threading.setprofile` (the engine posts async collectives on a
worker thread) record (file, qualified name) of every Python call while the scenario runs; the test
asserts that every READING.md entry SCENARIOS names for it was called (a Class entry: any of its
methods; a function: itself). Cost: one 2-rank spawn, a few seconds.
"""
import os
import sys
import threading

import pytest
import torch
import torch.nn as nn

from benchmarks import textbook as T

# scenario → the READING.md ideas that must run in it
SCENARIOS = {
    "all_reduce ring": ["point-to-point", "chunk rule", "reduce ops", "ring all-reduce"],
    "ZeRO-3 step": ["shard layout", "ZeRO-1", "ZeRO-2", "ZeRO-3", "sharded Adam"],
    "1F1B step": ["pipeline instruction", "1F1B", "pipeline executor", "executor forward", "executor backward"],
    "column-parallel forward": ["f (copy to tp)", "column parallel"],
}


class _Trace:
    """Every (co_filename, co_qualname) called in this process while active, on every thread."""

    def __init__(self):
        self.calls = set()

    def _hook(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            self.calls.add((code.co_filename, code.co_qualname))

    def __enter__(self):
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def _all_reduce_ring(rank, world):
    import primitives
    t = torch.arange(1000, dtype=torch.float32) + rank
    primitives.all_reduce(t, algorithm="ring")
    assert torch.equal(t, 2 * torch.arange(1000, dtype=torch.float32) + 1)


def _zero3_step(rank, world):
    import zero_from_scratch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}
    engine = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    loss = nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()


def _one_f_one_b_step(rank, world):
    import pipeline_parallel
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    pm = pipeline_parallel.PipelineModule(layers, num_stages=2, loss_fn=nn.functional.cross_entropy)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "pipeline": {"schedule": "1f1b"}}
    engine = pipeline_parallel.initialize(model=pm, config=cfg)[0]
    g = torch.Generator().manual_seed(1)
    engine.train_batch(iter([(torch.randn(2, 8, generator=g), torch.randint(0, 4, (2,), generator=g))
                             for _ in range(4)]))


def _column_parallel_forward(rank, world):
    import primitives
    import tensor_parallel
    torch.manual_seed(0)
    full = nn.Linear(8, 6)
    layer = tensor_parallel.ColumnParallelLinear(full, primitives.get_comm())   # the world's communicator
    lo, hi = layer.bounds
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), full(x)[:, lo:hi])


RUNS = {"all_reduce ring": _all_reduce_ring, "ZeRO-3 step": _zero3_step, "1F1B step": _one_f_one_b_step,
        "column-parallel forward": _column_parallel_forward}


def _traced(rank, world, root):
    """{scenario: [(relative path, qualname) of calls in this checkout]} on this rank."""
    out = {}
    for name, fn in RUNS.items():
        with _Trace() as tr:
            fn(rank, world)
        out[name] = sorted({(os.path.relpath(f, root), q) for f, q in tr.calls if f.startswith(root + os.sep)})
    return out


def _ran(entry, calls) -> bool:
    return any(f == entry.path and (q == entry.name or q.startswith(entry.name + ".")) for f, q in calls)


@pytest.fixture(scope="module")
def traces():
    from primitives.launch import spawn
    return spawn(_traced, 2, args=(T.ROOT,), timeout=180.0)


def test_every_scenario_idea_is_in_reading():
    ideas = {e.idea for e in T.reading_entries()}
    missing = sorted({i for want in SCENARIOS.values() for i in want} - ideas)
    assert not missing, f"READING.md has no entry for {missing}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reading_functions_run_on_the_default_path(traces, scenario):
    entries = {e.idea: e for e in T.reading_entries()}
    bad = []
    for idea in SCENARIOS[scenario]:
        e = entries.get(idea)
        if e is None:
            bad.append(f"{idea}: no READING.md entry")
            continue
        silent = [r for r, tr in enumerate(traces) if not _ran(e, tr[scenario])]
        if silent:
            ran = sorted({f for tr in traces for f, _ in tr[scenario]})
            bad.append(f"{idea} ({e.path}::{e.name}) did not run on ranks {silent}; files that ran: {ran}")
    assert not bad, f"{scenario}:\n  " + "\n  ".join(bad)
