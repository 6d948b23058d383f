"""multinode: up/down/status/run on a real (namespaced) cluster. Skipped, with the reason, where
network namespaces are not allowed (not root, or `ip netns` refused)."""
from __future__ import annotations

import io
import os
import subprocess
import time

import pytest

from multinode import cluster as C
from multinode.run import run
from tests.multinode_util import cluster, requires_netns, unique_name

pytestmark = requires_netns


def test_up_down_20_times_leaves_nothing():
    name = unique_name()
    before = set(C.list_namespaces())
    t0 = time.monotonic()
    try:
        for _ in range(20):
            c = C.up(2, 400, name)
            assert sorted(C.ours(name)) == sorted([c.ns(0), c.ns(1), c.switch])
            assert C.tc_rate(c, 0) == "400Mbit" and C.tc_rate(c, 1) == "400Mbit"
            assert os.path.exists(c.state_path())
            C.down(name)
            assert C.ours(name) == [] and not os.path.exists(C.state_path(name))
    finally:
        C.down(name)
    # others may create namespaces concurrently: only ours must be gone
    assert not [n for n in set(C.list_namespaces()) - before if n.startswith(name)]
    assert time.monotonic() - t0 < 120


def test_down_is_idempotent_and_cleans_up_after_a_crash():
    name = unique_name()
    try:
        assert C.down(name) == []                        # nothing there: not an error
        c = C.up(2, 100, name)
        with pytest.raises(C.ClusterError, match="already up"):
            C.up(2, 100, name)
        # a "crashed" session: a process left running inside a node, the state file lost
        stray = subprocess.Popen(["ip", "netns", "exec", c.ns(1), "sleep", "300"])
        os.remove(c.state_path())
        with pytest.raises(C.ClusterError, match="no cluster named"):
            C.load(name)
        removed = C.down(name)
        assert sorted(removed) == sorted([c.ns(0), c.ns(1), c.switch])
        assert stray.wait(timeout=10) != 0               # it was ended, not left behind
        assert C.down(name) == []
    finally:
        C.down(name)


def test_bad_input_and_not_root(monkeypatch):
    with pytest.raises(C.ClusterError, match="--nodes 1"):
        C.up(1, 400, unique_name())
    with pytest.raises(C.ClusterError, match="cluster name"):
        C.up(2, 400, "Bad-Name")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(C.ClusterError, match="needs root"):
        C.up(2, 400, unique_name())


def test_status_measures_the_shaped_link():
    from multinode.pingpong import measure
    with cluster(2, 100) as c:
        inter = measure(c.ns(1), c.ns(0), c.addrs[1])
        intra = measure(c.ns(0), c.ns(0), "127.0.0.1")
    # tbf at 100 Mbit/s; loopback is unshaped (GB/s). A wide band: the machine is shared.
    assert 50 < inter["mbit_per_s"] < 110, inter
    assert intra["mbit_per_s"] > 5 * inter["mbit_per_s"], (intra, inter)


def test_run_sets_the_environment_per_node():
    with cluster() as c:
        out = io.StringIO()
        code, err = run(c, 'echo "R=$NODE_RANK N=$NNODES M=$MASTER_ADDR P=$MASTER_PORT H=$(hostname) '
                           'I=$GLOO_SOCKET_IFNAME"', timeout=30, port=29611, out=out)
        assert (code, err) == (0, None)
        lines = sorted(out.getvalue().splitlines())
    assert lines == [f"[node {i}] R={i} N=2 M=10.77.0.1 P=29611 H={c.ns(i)} I=rzeth" for i in range(2)]


def test_a_dying_node_ends_every_process_with_an_error_naming_node_and_rank():
    with cluster() as c:
        t0 = time.monotonic()
        # node 0 would wait for 5 minutes; node 1's "rank 3" dies after half a second
        code, err = run(c, 'if [ "$NODE_RANK" = 1 ]; then sleep 0.5; echo "rank 3: simulated failure" >&2; '
                           'exit 7; else sleep 300; fi', timeout=60, grace=2, out=io.StringIO())
        took = time.monotonic() - t0
        left = [subprocess.run(["ip", "netns", "pids", c.ns(i)], capture_output=True, text=True).stdout.split()
                for i in range(2)]
    assert code == 7 and "node 1" in err and "rank(s) 3" in err, err
    assert took < 15, took
    assert left == [[], []]


def test_run_timeout_ends_everything():
    with cluster() as c:
        code, err = run(c, "sleep 300", timeout=1.5, grace=1, out=io.StringIO())
        assert code == 124 and "timed out" in err and "[0, 1]" in err
        assert all(not subprocess.run(["ip", "netns", "pids", c.ns(i)], capture_output=True,
                                      text=True).stdout.split() for i in range(2))
