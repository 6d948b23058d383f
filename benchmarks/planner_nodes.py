"""benchmarks.planner_local's two-node row: the DDP step with one rank on each of two nodes of
multinode/'s cluster on this machine (network namespaces joined by a tbf-shaped 400 Mbit/s veth;
tests/test_multinode_launch.py starts it the same way).

    python -m benchmarks.planner_local --only "2 nodes"       # the row (needs root and iproute2)
    python -m benchmarks.planner_nodes SHAPE MB STEPS         # one rank, as torchrun starts it in a node

Both nodes are this machine's cores: beside the load the probe reads, each rank has the other
node's rank as one more task (benchmarks.planner_local). Cost: the cluster's start and stop (~2 s) and two torchrun start-ups.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys

from benchmarks.planner_ranks import SHAPES, _rank
from primitives.launch import init_from_env


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _multinode():
    """(multinode.cluster, multinode.run.run). Imported here, with the repository root first on
    sys.path: run by path, benchmarks/ comes first and its multinode.py would shadow the package."""
    if sys.path[:1] != [ROOT]:
        sys.path.insert(0, ROOT)
    from multinode import cluster  # noqa: E402  (after the path fix above)
    from multinode.run import run  # noqa: E402  (the same)
    return cluster, run


def node_rank(shape: int, mb: int, steps: int) -> None:
    """One rank of the row, started by torchrun inside a node's namespace: its result as one JSON line."""
    comm = init_from_env("gloo")
    got = _rank(comm.rank, comm.size, SHAPES[shape], mb, steps)
    print("PLANNER_ROW " + json.dumps(got), flush=True)


def on_two_nodes(shape: int, mb: int, steps: int) -> list[dict]:
    """Run the row on a fresh two-node cluster (always taken down); each rank's result."""
    C, run = _multinode()
    root = ROOT
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")    # the nodes inherit it
    cmd = (f"cd {root} && {sys.executable} -m torch.distributed.run --nnodes 2 --nproc_per_node 1 "
           f"--node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT "
           f"-m benchmarks.planner_nodes {shape} {mb} {steps}")
    name, out = f"rzp{os.getpid() % 10**6}", io.StringIO()
    try:
        c = C.up(2, 400.0, name)
        code, err = run(c, cmd, timeout=600, out=out)
    finally:
        C.down(name)
    if code:
        raise RuntimeError(f"two-node row failed: {err}\n{out.getvalue()[-3000:]}")
    return [json.loads(ln.split("PLANNER_ROW ", 1)[1]) for ln in out.getvalue().splitlines() if "PLANNER_ROW " in ln]


def two_nodes_possible() -> str:
    """'' when multinode's cluster can start here, else why not."""
    try:
        C, _ = _multinode()
        C.require_root()
    except Exception as e:            # not root, no iproute2, namespaces refused
        return str(e)
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", type=int, help="index into benchmarks.planner_local.SHAPES")
    ap.add_argument("mb", type=int)
    ap.add_argument("steps", type=int)
    a = ap.parse_args(argv)
    node_rank(a.shape, a.mb, a.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
