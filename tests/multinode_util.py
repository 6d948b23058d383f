"""Shared by tests/test_multinode*.py: skip unless namespaces work, and a cluster per test with a
unique name (so concurrent runs never collide) that is always taken down in a finally block."""
from __future__ import annotations

import contextlib
import os
import uuid

import pytest

from multinode import cluster as C


def skip_reason() -> str | None:
    try:
        C.require_root()
    except C.ClusterError as e:
        return str(e)
    except Exception as e:          # e.g. iproute2 missing entirely
        return f"network namespaces unavailable: {e}"
    return None


requires_netns = pytest.mark.skipif(skip_reason() is not None, reason=f"multinode: {skip_reason()}")


def unique_name() -> str:
    return f"rzt{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def cluster(nodes: int = 2, link_mbit: float = 400.0):
    name = unique_name()
    try:
        yield C.up(nodes, link_mbit, name)
    finally:
        C.down(name)
        assert not C.ours(name), f"left behind: {C.ours(name)}"


def venv_env() -> dict:
    """PATH with this interpreter's bin first (torchrun, deepspeed, mpiexec) and the checkout importable."""
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
