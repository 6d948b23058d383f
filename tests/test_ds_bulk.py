"""DeepSpeed's own unit-test files (tests/ds_bulk/upstream, unchanged) under the installed DeepSpeed and ringzero.

    python -m pytest -q tests/test_ds_bulk.py                  (the quick subset: topology's own cases, ~40 s)
    python -m pytest -q -m slow tests/test_ds_bulk.py          (every copied file, both engines: hours on 2 cores)
    python -m tests.ds_bulk.table                              (the table from the last full run)

run.py runs one pytest per (file, engine) with DeepSpeed's conftest.py, so its DistributedTest starts
the gloo ranks; ringzero's side has `import deepspeed` served by the runner's finder. A case that
passes under DeepSpeed must pass under ringzero, or fail with ringzero's one-line refusal (table.py).
The files are DeepSpeed's, not kept in git: `python -m tests.upstream` copies them from a clone.
"""
import json
import os

import pytest

from tests import upstream
from tests.ds_bulk import run, table

QUICK = "unit/runtime/pipe/test_topology.py"


def test_the_table_classifies_passes_refusals_and_failures():
    ds = {"f.py::a": ["passed", ""], "f.py::b": ["passed", ""], "f.py::c": ["passed", ""], "f.py::d": ["skipped", "x"],
          "f.py::e": ["passed", ""]}
    rz = {"f.py::a": ["passed", ""], "f.py::c": ["failed", "E   AssertionError: 1 != 2"],
          "f.py::b": ["failed", "E   NotServedError: deepspeed.runtime.pipe.schedule is not served by ringzero (...)"],
          "f.py::e": ["failed", "E   ValueError: config key 'amp' = {'enabled': True} is refused: not implemented here"]}
    (r,) = table.rows(ds, rz)
    assert (r["collected"], r["ds_pass"], r["both"], len(r["failing"])) == (5, 4, 1, 1)
    assert dict(r["refused"]) == {"not served: deepspeed.runtime.pipe.schedule": 1,
                                  "config key 'amp' is refused: not implemented here": 1}


@pytest.mark.deepspeed
@pytest.mark.timeout(900)
@upstream.skip_unless_present("tests/ds_bulk/upstream/" + QUICK)
def test_topology_file_passes_under_both(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setattr(run, "RESULTS", str(tmp_path))
    res = {m: run.run_file(QUICK, m, 600, select="not TestDistributedTopology") for m in run.MODES}
    passed = {m: sorted(k for k, v in r.items() if v[0] == "passed") for m, r in res.items()}
    assert len(passed["deepspeed"]) >= 7 and passed["ringzero"] == passed["deepspeed"], res


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.timeout(6 * 3600)
@upstream.skip_unless_present("tests/ds_bulk/upstream/" + QUICK)
def test_every_file_at_least_as_recorded(tmp_path, monkeypatch):
    """Rerun every copied file on both engines: no fewer cases pass under both than README.md records."""
    pytest.importorskip("deepspeed")
    recorded = json.load(open(os.path.join(run.HERE, "results", "ringzero.json")))
    before = sum(r["both"] for r in table.rows(*table.load()))
    monkeypatch.setattr(run, "RESULTS", str(tmp_path))
    run.main([])
    monkeypatch.setattr(table, "RESULTS", str(tmp_path))
    after = sum(r["both"] for r in table.rows(*table.load()))
    assert recorded and after >= before
