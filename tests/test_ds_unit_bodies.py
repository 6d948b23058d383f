"""Bodies in DeepSpeed's test style for the runner's quirks (tests/ds_unit/), under the real DeepSpeed and ringzero.

    python -m pytest -q tests/test_ds_unit_bodies.py                 (the quick subset, ~30 s)
    python -m pytest -q -m slow tests/test_ds_unit_bodies.py         (every body in tests/ds_unit/selection.py)
    python -m tests.ds_unit.harness --all                            (the same, as a table)

Each body runs on its ranks twice, in fresh processes: once with `import deepspeed` the installed
DeepSpeed 0.19.8, once with it served by ringzero (zero_from_scratch.as_deepspeed's finder). A body
passes when it passes under both and every value the harness recorded (each loss given to
engine.backward or returned by train_batch, each set of parameters after load_checkpoint) agrees
within harness.TOLERANCE: 1e-5 relative in fp32, 1e-2 in bf16 (the reasons are written there).
DeepSpeed's own test files run whole, unchanged, in tests/ds_bulk (tests/test_ds_bulk.py).
"""
import os

import pytest

from tests.ds_unit import harness, selection

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_unit")


def _failures(bodies, res) -> list[str]:
    return [f"{b.id} rank {r}: " + "; ".join(bad) for b in bodies for r in range(b.world)
            for bad in [harness.compare(*res[(b.id, r)], b.tol)] if bad]


def test_compare_sees_a_difference_past_the_tolerance_and_none_within():
    ok = ("ok", [("loss", 2.0), ("loaded", [1.0, -3.0])])
    near = ("ok", [("loss", 2.0 * (1 + 5e-6)), ("loaded", [1.0, -3.0])])
    far = ("ok", [("loss", 2.0), ("loaded", [1.0, -3.0 * (1 + 3e-5)])])
    assert harness.compare(ok, near, "fp32") == [] and harness.compare(ok, far, "bf16") == []
    assert "loaded" in harness.compare(ok, far, "fp32")[0]
    assert harness.compare(ok, ("ok", [("loss", 2.0)]), "fp32")[0].startswith("records differ")
    assert "status" in harness.compare(ok, ("error", "Traceback ... boom"), "fp32")[0]
    assert harness.compare(("skip", "x"), ("skip", "y"), "fp32") == []


def test_every_body_is_in_the_readme_table():
    table = open(os.path.join(HERE, "README.md")).read()
    funcs = {b.target.split(":")[1] for b in harness.selection()}
    missing = sorted(f for f in funcs if f"`{f}`" not in table)
    assert not missing, f"README.md's table lacks {missing}"
    assert len(funcs) >= 5


@pytest.mark.slow
@pytest.mark.deepspeed
def test_quick_bodies_equal_under_deepspeed_and_ringzero():
    pytest.importorskip("deepspeed")
    bodies = [b for b in selection.BODIES if b.quick]
    res = harness.run_both(bodies, timeout=300.0)
    assert not _failures(bodies, res)
    assert all(res[(b.id, r)][0][0] == "ok" for b in bodies for r in range(b.world))   # none skipped
    trained = [res[(b.id, 0)][1][1] for b in bodies if res[(b.id, 0)][1][1]]
    assert len(trained) >= 3     # bodies that recorded losses: the comparison compared numbers


@pytest.mark.slow
@pytest.mark.deepspeed
def test_every_body_equal_under_deepspeed_and_ringzero():
    pytest.importorskip("deepspeed")
    res = harness.run_both(selection.BODIES, timeout=1500.0)
    assert not _failures(selection.BODIES, res)
    assert all(res[(b.id, r)][0][0] == "ok" for b in selection.BODIES for r in range(b.world))
