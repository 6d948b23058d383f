"""Launchers across the two namespaced nodes: torchrun (primitives, ddp_examples, zero_from_scratch),
deepspeed --no_ssh, and mpiexec through hydra's ssh launcher pointed at multinode/rsh.py.

The primitives check runs by default; the heavier launches are
@pytest.mark.slow (python -m pytest -m slow tests/test_multinode_launch.py)."""
from __future__ import annotations

import io
import json
import os
import re
import time

import pytest

from multinode.run import run
from tests.multinode_util import cluster, requires_netns, venv_env

pytestmark = requires_netns
TORCHRUN = ("torchrun --nnodes 2 --nproc_per_node 2 --node_rank $NODE_RANK --master_addr $MASTER_ADDR "
            "--master_port $MASTER_PORT ")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(c, cmd, timeout=300, **kw):
    old = {k: os.environ.get(k) for k in venv_env()}
    os.environ.update(venv_env())           # the node commands inherit this process's environment
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        out = io.StringIO()
        code, err = run(c, cmd, timeout=timeout, out=out, **kw)
        return code, err, out.getvalue()
    finally:
        os.chdir(cwd)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_torchrun_every_collective_across_nodes():
    with cluster(2, 400) as c:
        code, err, out = _run(c, TORCHRUN + "tests/multinode_worker.py --timeout 60", timeout=240)
    assert code == 0 and "MULTINODE CHECK OK on 4 ranks, 2 nodes" in out, (err, out[-3000:])
    assert f"hosts by rank: ['{c.ns(0)}', '{c.ns(0)}', '{c.ns(1)}', '{c.ns(1)}']" in out


@pytest.mark.slow      # the same end-everything path at the shell level runs by default (test_multinode.py)
def test_a_rank_dying_on_node_1_ends_both_nodes():
    with cluster(2, 400) as c:
        t0 = time.monotonic()
        code, err, out = _run(c, TORCHRUN + "tests/multinode_worker.py --die 3 --timeout 60", timeout=120, grace=3)
        took = time.monotonic() - t0
        left = [os.popen(f"ip netns pids {c.ns(i)}").read().split() for i in range(2)]
    assert code != 0 and "node 1" in err and re.search(r"rank\(s\) [^;]*\b3\b", err), (err, out[-2000:])
    assert "(wrong)" not in out
    assert took < 100 and left == [[], []]


def _row(out: str, label: str) -> str:
    m = re.search(r"│ " + re.escape(label) + r"\s*│\s*([^│]+?)\s*│", out)
    assert m, f"row {label!r} missing:\n{out[-3000:]}"
    return m.group(1)


@pytest.mark.slow
def test_torchrun_ddp_bucketed_parity_across_nodes():
    with cluster(2, 400) as c:
        code, err, out = _run(c, TORCHRUN + "ddp_examples/04_bucketed.py --steps 6 --bucket-cap-mb 0.004")
    assert code == 0, (err, out[-3000:])
    assert _row(out, "ranks × micro-batches") == "4 × 1"
    assert float(_row(out, "max |param − single-process param|")) <= 1e-5    # as tests/test_ddp_launch.py
    assert float(_row(out, "max |param − rank 0 param|")) == 0.0


@pytest.mark.slow
def test_torchrun_zero2_parity_across_nodes():
    with cluster(2, 400) as c:
        code, err, out = _run(c, TORCHRUN + "tests/multinode_worker.py --zero2")
    assert code == 0 and "ZERO2 PARITY OK" in out, (err, out[-3000:])


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_no_ssh_across_nodes(tmp_path):
    from tests.test_classification_train import COMMON, NEG, NOUNS, POS, TINY
    with open(tmp_path / "easy.jsonl", "w") as f:
        for i in range(120):
            lab = i % 2
            f.write(json.dumps({"text": f"the {NOUNS[i % 10]} was {(POS if lab else NEG)[(i // 2) % 8]}",
                                "label": lab}) + "\n")
    with open(tmp_path / "tiny.json", "w") as f:
        json.dump(TINY, f)
    with cluster(2, 400) as c:
        code, err, out = _run(
            c, "deepspeed --hostfile $HOSTFILE --no_ssh --node_rank $NODE_RANK --master_addr $MASTER_ADDR "
               f"--master_port $MASTER_PORT classification/train.py --dataset {tmp_path}/easy.jsonl "
               f"--config {tmp_path}/tiny.json --max-steps 3 --epochs 1 {COMMON} --output-dir {tmp_path}/out",
            timeout=500)
    assert code == 0, (err, out[-4000:])
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        m = [json.loads(line) for line in f]
    assert [x["step"] for x in m if x["event"] == "train"] == [1, 2, 3]
    assert [x for x in m if x["event"] == "test"][0]["world_size"] == 4


@pytest.mark.slow
@pytest.mark.mpi
def test_mpiexec_across_hosts_without_ssh():
    with cluster(2, 400) as c:
        code, err, out = _run(
            c, 'if [ "$NODE_RANK" = 0 ]; then MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -launcher ssh '
               '-launcher-exec "$RINGZERO_RSH" -hosts ' + ",".join(c.addrs) + ' -ppn 2 -n 4 -iface rzeth '
               'python tests/mpi_worker.py; fi', timeout=400)
    assert code == 0 and "MPI CHECK OK on 4 ranks" in out, (err, out[-3000:])


FLAGSHIPS = ["allreduce.py", "allgather.py", "reducescatter.py"] + [
    f"run.py {name}" for name in ("broadcast", "reduce", "scatter", "gather", "all_to_all")]


def _formula_rows(out: str) -> list[str]:
    """The table rows of a runner script whose per-rank ledger disagreed with its formula (or
    whose result disagreed with the built-in)."""
    return [line for line in out.splitlines() if "│" in line and ("NO" in line or "FAIL" in line)]


def test_flagship_allreduce_every_row_matches_its_formula_across_nodes():
    """primitives/allreduce.py across 2 nodes × 2 ranks: the hierarchical and auto rows count
    m nodes × k ranks per node (traffic(local=k)), not one flat ring of 4."""
    with cluster(2, 400) as c:
        code, err, out = _run(c, TORCHRUN + "primitives/allreduce.py --size 65536 --iters 1", timeout=240)
    assert code == 0 and not _formula_rows(out), (err, out[-3000:])
    assert re.search(r"│ auto\s*│ hierarchical\s*│ pass", out), out[-3000:]


@pytest.mark.slow
def test_every_flagship_script_exits_0_across_nodes():
    """The collective scripts with their default sizes across the cluster: every row agrees with
    its formula on every rank (the runner exits 1 otherwise)."""
    with cluster(2, 400) as c:
        for script in FLAGSHIPS:
            code, err, out = _run(c, TORCHRUN + f"primitives/{script}", timeout=300)
            assert code == 0 and not _formula_rows(out), (script, err, out[-3000:])
