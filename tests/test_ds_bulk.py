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
import subprocess
import sys
import textwrap

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


# DeepSpeed's DistributedFixture in miniature (tests/unit/common.py, conftest.py): a class whose base says
# `is_dist_fixture`, run by a tryfirst pytest_fixture_setup hook that returns nothing
DIST_FIXTURE_FILES = {
    "conftest.py": """
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_fixture_setup(fixturedef, request):
            if getattr(fixturedef.func, "is_dist_fixture", False):
                fixturedef.func()(request)
    """,
    "test_x.py": """
        import pytest

        class DistributedFixture:
            is_dist_fixture = True

            def __call__(self, request):
                self.run(request.getfixturevalue("tmp_path"), request.getfixturevalue("param"))

        @pytest.fixture(params=[1, 2, 3, 4])
        def param(request):
            return request.param

        class writes_file(DistributedFixture):
            def run(self, tmp_path, param):
                if param == 2:
                    raise RuntimeError("a rank failed")
                if param == 3:
                    pytest.skip("a rank skipped")
                (tmp_path / "ran").write_text(str(param))

        def test_uses(writes_file, tmp_path, param):
            assert (tmp_path / "ran").read_text() == str(param)
    """,
    # DeepSpeed's test_fp16.py and others skip at module level on a CPU: pytest reports the file as skipped
    "test_skipmod.py": """
        import pytest

        pytest.skip("no accelerator", allow_module_level=True)

        def test_never():
            pass
    """}


@pytest.mark.parametrize("plugin", [True, False], ids=["with_plugin", "without"])
def test_distributed_fixture_classes_are_fixtures_with_the_plugin(tmp_path, plugin):
    """dist_fixtures.py: each case gets its own outcome (a failing or skipping fixture does not poison the
    next case), and a module that skips at import is reported skipped beside them (not a session abort);
    without the plugin pytest >= 8.4 does not find the fixture at all."""
    for name, text in DIST_FIXTURE_FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
           f"--junitxml={tmp_path}/r.xml", "test_x.py", "test_skipmod.py"] + (["-p", "tests.ds_bulk.dist_fixtures"] if plugin else [])
    subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": run.ROOT}, capture_output=True, timeout=120)
    parsed = run.parse(f"{tmp_path}/r.xml", "test_x.py")
    skipmod = parsed.pop("test_x.py::test_skipmod")     # a collection skip: junit names the case after the file
    assert skipmod == ["skipped", "collection skipped"], skipmod
    res = {k.rpartition("[")[2].rstrip("]"): v for k, v in parsed.items()}
    if plugin:
        assert [res[p][0] for p in "1234"] == ["passed", "error", "skipped", "passed"], res
        assert "a rank failed" in res["2"][1] and "a rank skipped" in res["3"][1]
    else:
        assert all(v[0] == "error" and "fixture 'writes_file' not found" in v[1] for v in res.values()), res


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


TABLE_BLOCK = r"<!-- (?:\w+ )?table: python -m ([\w.]+) --markdown[^\n]*-->\n(.*?)<!-- /(?:\w+ )?table -->"


@pytest.mark.parametrize("readme", ["tests/ds_bulk/README.md", "tests/ds_unit/README.md", "tests/hf_suites/README.md"])
def test_tables_in_the_readmes_are_what_their_command_prints(readme):
    """Each table a README keeps between `<!-- table: python -m MODULE --markdown -->` and its closing marker is
    that command's output from the recorded results (results/*.json), not an older copy."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, readme)) as f:
        blocks = re.findall(TABLE_BLOCK, f.read(), re.S)
    assert blocks, f"{readme} keeps no table between markers"
    for module, kept in blocks:
        printed = subprocess.run([sys.executable, "-m", module, "--markdown"], capture_output=True, text=True,
                                 cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True).stdout
        assert kept.strip() == printed.strip(), f"{readme}: the table is not `python -m {module} --markdown`'s output"
