"""Shared fixtures. `spawn` runs a function on N fresh ranks (primitives.launch.spawn):
file-store rendezvous, a deadline, per-rank exit codes and tracebacks; the first failing rank
ends the run, so a multi-rank test fails instead of hanging."""
import functools
import os
import shutil
import subprocess
import sys

import pytest

from primitives.launch import spawn as _spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the suite starts hundreds of interpreters that import the same modules: they share the bytecode
# Python caches in __pycache__ (git ignores it), even where the environment turned the cache off
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# every process a test starts (torchrun, deepspeed, scripts run by path) imports this checkout
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")


# `make test` runs the suite on two pytest-xdist workers: half of a serial run's wall time is ranks
# waiting on each other. Tests that build network namespaces share one worker (`--dist loadgroup`), and
# so do the `--help` checks, whose module fixture runs every script's --help once (~40 s) per worker, and
# the tests of a file that share a module-scoped fixture.
SERIAL_FILES = {"test_multinode.py", "test_multinode_collectives.py", "test_multinode_launch.py"}


def pytest_configure(config):
    """Other projects' files the suites run are copied, not kept (tests/upstream.py): where a clone
    of their repository is found, write them before collection, so the tests that need them run."""
    from tests import upstream
    try:
        upstream.copy(quiet=True)
    except Exception as e:      # a broken clone must not stop the suite: the tests needing copies skip
        print(f"tests/upstream.py: copies not written ({type(e).__name__}: {e})", file=sys.stderr)


# Files whose tests are end-to-end runs of tens of seconds each: started first, so that the run does
# not end on one worker finishing a long test while the other has nothing left (xdist hands out work in
# collection order, groups with the most tests first).
LONG_FIRST = ("test_tutorials.py", "test_readme_commands.py", "test_classification_train.py", "test_recipes_lora.py",
              "test_recipes_tied.py", "test_recipes_offload.py", "test_pipeline_parity.py", "test_tensor_parallel_model.py")


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return bool(info) and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_FILES or "11_multi_node" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif item.path.name == "test_script_usage.py" and item.name.startswith("test_help["):
            item.add_marker(pytest.mark.xdist_group("help"))
        elif _uses_module_fixture(item):    # one worker builds the file's module fixtures once, not each worker
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)     # stable: the order within each part stays
    yield       # pytest-xdist 3.8 puts a test in its group by renaming it: `item._nodeid = "...@group"`
    try:        # pytest 9 reads a test's name from `item._id`, where xdist's renaming would be lost
        from _pytest.nodeid import NodeId
    except ImportError:         # an older pytest reads _nodeid itself
        return
    for item in items:
        renamed = item.__dict__.get("_nodeid")
        if renamed and renamed != item.nodeid:
            item._id = NodeId.parse(renamed)


@pytest.fixture
def spawn():
    return functools.partial(_spawn, timeout=180.0)


def cmd_env(env=None) -> dict:
    """The environment of a command run here: this venv first on PATH, one OpenMP thread, then `env`."""
    e = dict(os.environ)
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update(env or {})
    return e


def run_cmd(cmd, timeout=300, env=None, check=True):
    """Run a shell command from the repo root with this venv first on PATH; return the result."""
    r = subprocess.run(cmd, shell=True, cwd=ROOT, env=cmd_env(env), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"command failed ({r.returncode}): {cmd}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}")
    return r


def have_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) is not None
