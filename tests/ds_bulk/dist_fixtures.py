"""pytest plugin for the bulk run: DeepSpeed's `DistributedFixture` classes become fixtures again.

    python -m tests.ds_bulk.run --mode deepspeed unit/comm/test_dist.py   # run.py loads it (-p) in both modes

DeepSpeed's tests/unit/common.py makes a class a fixture by giving it the attribute
`_pytestfixturefunction = FixtureFunctionMarker(...)`: pytest before 8.4 found fixtures by that
attribute. pytest >= 8.4 finds only `FixtureFunctionDefinition` objects (what `@pytest.fixture`
returns), so a test asking for such a class by name (`baseline_ws2`, `distributed_fixture`, ...) fails
with "fixture not found" before DeepSpeed is ever imported: a harness error, not DeepSpeed's. The upstream
files stay byte for byte (tests/test_ds_bulk.py checks their hashes), so this plugin does what the older
pytest did: in a test module's collect step, once it is imported, each `DistributedFixture` subclass in its namespace is
registered as a function-scoped fixture named after the module attribute (the class name), visible to
that module's tests. DeepSpeed's own conftest `pytest_fixture_setup` then recognises it
(`is_dist_fixture`), instantiates it and spawns its ranks, as it did on older pytest; pytest's default
setup afterwards calls the class with no arguments, the cached fixture value (again as before).
When DeepSpeed's hook raises (a rank failed or skipped), pytest's own setup never runs, so nothing
records the failure; pytest >= 8.4 then refuses the fixture's next use ("assert not self._finalizers")
and every later case of the file errors with a bare AssertionError. The wrapper below records the
exception on the fixture as pytest's own setup does for any fixture, so each case gets its own outcome.
Needs pytest >= 9.1 (`pytest.register_fixture`, public from 9.1); an older pytest stops at the plugin's
import with a message saying so.
Cost: one pass over each test module's names at collection.
"""
from __future__ import annotations

import inspect

import pytest
from _pytest.outcomes import TEST_OUTCOME   # what pytest's own fixture setup records: Exception, skip, fail

if not hasattr(pytest, "register_fixture"):
    raise ImportError(f"tests/ds_bulk/dist_fixtures.py needs pytest >= 9.1 (pytest.register_fixture), "
                      f"this is pytest {pytest.__version__}")



def distributed_fixtures(module) -> dict[str, type]:
    """The DistributedFixture subclasses in `module`'s namespace, by attribute name. The base class
    (which defines `is_dist_fixture` in its own body) is left out: it has no `run` to spawn."""
    return {name: obj for name, obj in vars(module).items()
            if inspect.isclass(obj) and getattr(obj, "is_dist_fixture", False) and "is_dist_fixture" not in vars(obj)}


class _Module(pytest.Module):
    """A test module whose DistributedFixture classes are registered once the module is imported.
    It happens inside `collect`, which pytest runs under its own outcome handling: an import error or a
    module-level `pytest.skip` is reported for this file as pytest reports it, never a session abort."""

    def collect(self):
        for name, cls in distributed_fixtures(self.obj).items():    # self.obj imports the module
            pytest.register_fixture(name=name, func=cls, scope="function", node=self)
        return super().collect()


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    return _Module.from_parent(parent, path=module_path)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    try:
        return (yield)
    except TEST_OUTCOME as e:
        if getattr(fixturedef.func, "is_dist_fixture", False) and fixturedef.cached_result is None:
            fixturedef.cached_result = (None, fixturedef.cache_key(request), (e, e.__traceback__))
        raise
