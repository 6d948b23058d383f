"""Shared by tests/test_multinode*.py: skip unless namespaces work, and a cluster per test with a
unique name (so concurrent runs never collide) that is always taken down in a finally block."""
from __future__ import annotations

import contextlib
import os
import sys
import uuid

import pytest
import torch

import primitives as P
from primitives.engine.cost import link_traffic

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


TWO_LEVEL = ["all_reduce", "all_gather", "all_gather_single", "reduce_scatter", "reduce_scatter_single"]


def checks_on_two_nodes(rank, world, local=2, numels=(0, 1, 5, 1001)):
    """Every two-level-capable collective × algorithm vs the built-in, then the per-link ledger
    of each all-reduce / all-gather / reduce-scatter algorithm vs cost.link_traffic.
    Runs on a rank; returns (errors, node_of, intra members, inter members, auto's choice)."""
    if local is not None:                     # one host pretending; under a launcher the env says
        os.environ.setdefault("RINGZERO_LOCAL_SIZE", str(local))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import collective_checks as C
    from primitives.engine.ledger import LEDGER
    comm = P.get_comm()
    local = world // comm.inter_node().size
    errs, _ = C.matrix(comm, list(numels), names=TWO_LEVEL, local=local)
    e2, _ = C.matrix(comm, [37], dtype=torch.float32, ops=("sum", "avg", "max"),
                     names=["all_reduce", "reduce_scatter_single"], local=local)
    errs += e2
    flat = {"all_reduce": ["linear", "ring", "direct", "recursive_doubling", "rabenseifner", "hierarchical"],
            "all_gather_single": ["linear", "ring", "direct", "hierarchical"],
            "reduce_scatter_single": ["linear", "ring", "direct", "hierarchical"]}
    pow2 = world & (world - 1) == 0
    for name, algos in flat.items():
        for algo in algos:
            if algo in ("recursive_doubling", "rabenseifner") and not pow2:
                continue
            numel = 1003
            x = torch.ones(numel * (world if name == "reduce_scatter_single" else 1))
            LEDGER.reset()
            if name == "all_reduce":
                P.all_reduce(x, algorithm=algo)
            elif name == "all_gather_single":
                P.all_gather_single(torch.empty(world * numel), x, algorithm=algo)
            else:
                P.reduce_scatter_single(torch.empty(numel), x, algorithm=algo)
            got = {k: (v.msgs_sent, v.bytes_sent) for k, v in LEDGER.links.items() if v.msgs_sent}
            want = {k: v for k, v in link_traffic(name, algo, world, rank, numel, 4, local).items() if v[0]}
            if got != want:
                errs.append(f"rank {rank} {name}/{algo}: ledger per link {got} != link_traffic {want}")
    LEDGER.reset()
    P.all_reduce(torch.ones(10))
    return (errs, [comm.node_of(r) for r in range(world)], comm.intra_node().members,
            comm.inter_node().members, LEDGER.calls[-1].algorithm)
