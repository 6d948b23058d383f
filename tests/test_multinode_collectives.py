"""Topology, hierarchical collectives and per-link ledgers on 2 "nodes" × 2 ranks of one host
(RINGZERO_LOCAL_SIZE=2: ranks 0,1 are node 0 and ranks 2,3 node 1). No namespaces needed, so
these run everywhere; tests/test_multinode_launch.py reruns the same checks over the real link."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import primitives as P
from primitives.engine.cost import Links, Params, link_traffic, peers, predict_2level, traffic
from primitives.engine.topology import Topology, TopologyError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multinode_util import checks_on_two_nodes  # noqa: E402

def test_two_nodes_of_two_ranks(spawn):
    res = spawn(checks_on_two_nodes, 4)
    for r, (errs, nodes, intra, inter, auto) in enumerate(res):
        assert errs == [], "\n".join(errs[:20])
        assert nodes == [0, 0, 1, 1]
        assert intra == [r - r % 2, r - r % 2 + 1] and inter == [r % 2, r % 2 + 2]
        assert auto == "hierarchical"                      # auto: more than one node


def _one_node(rank, world):
    from primitives.engine.ledger import LEDGER
    comm = P.get_comm()
    P.all_reduce(torch.ones(10))
    return [comm.node_of(r) for r in range(world)], LEDGER.calls[-1].algorithm


def test_one_node_auto_stays_flat(spawn):
    for nodes, auto in spawn(_one_node, 2):
        assert nodes == [0, 0] and auto != "hierarchical"


def test_topology_from_env_and_errors():
    assert Topology.from_env(4, {"LOCAL_WORLD_SIZE": "2"}).nodes == (0, 0, 1, 1)
    assert Topology.from_env(6, {"LOCAL_SIZE": "3"}).nodes == (0, 0, 0, 1, 1, 1)
    assert Topology.from_env(4, {"RINGZERO_LOCAL_SIZE": "1", "LOCAL_WORLD_SIZE": "4"}).num_nodes == 4
    assert Topology.from_env(3, {}).nodes == (0, 0, 0)
    with pytest.raises(TopologyError, match="does not divide"):
        Topology.from_env(4, {"LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(TopologyError, match="same number of ranks"):
        Topology((0, 0, 1)).local_size()


@pytest.mark.parametrize("n,local", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_link_traffic_adds_up_to_traffic(n, local):
    """The per-link split of every algorithm sums to its total (cost.traffic), for every rank."""
    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        for algo in P.ALGORITHMS[name]:
            if algo in ("recursive_doubling", "rabenseifner") and n & (n - 1):
                continue
            for numel in (0, 1, 7, 1001):
                for r in range(n):
                    lt = link_traffic(name, algo, n, r, numel, 4, local)
                    tot = traffic(name, algo, n, r, numel, 4, local=local)
                    assert (lt["intra"][0] + lt["inter"][0], lt["intra"][1] + lt["inter"][1]) == tot, (name, algo, r)
                    if algo != "hierarchical":
                        assert sum(b for _, b in peers(name, algo, n, r, numel, 4)) == tot[1]


def test_hierarchical_crosses_the_slow_link_less():
    """m = 2 nodes × k ranks, S bytes: a node sends 2(m-1)/m·S = S across with the hierarchy,
    but the flat ring's one crossing rank per node sends 2(N-1)/N·S."""
    for k in (2, 4):
        n, numel = 2 * k, 1 << 12
        S = numel * 4
        node_inter = lambda algo: sum(link_traffic("all_reduce", algo, n, r, numel, 4, k)["inter"][1]  # noqa: E731
                                      for r in range(k))
        assert node_inter("hierarchical") == S
        assert node_inter("ring") == 2 * (n - 1) * S // n
        # all-gather of s bytes per rank: a node must send its k blocks to the other node, k·s
        s = 4 * 100
        assert sum(link_traffic("all_gather", "hierarchical", n, r, 100, 4, k)["inter"][1] for r in range(k)) == k * s
        assert sum(link_traffic("all_gather", "ring", n, r, 100, 4, k)["inter"][1] for r in range(k)) == (n - 1) * s


def test_two_level_model():
    slow = Links(intra=Params(1e-4, 1e-10, 1e-10), inter=Params(1e-4, 8 / 100e6, 1e-10))   # 100 Mbit/s
    S = 4 << 20
    ring = predict_2level("all_reduce", "ring", 2, 2, S, slow)
    hier = predict_2level("all_reduce", "hierarchical", 2, 2, S, slow)
    assert 1.3 < ring / hier < 1.5          # bandwidth term 1.5·S·β_e vs S·β_e, plus intra work
    for name in ("all_gather", "reduce_scatter"):
        assert predict_2level(name, "hierarchical", 2, 2, S, slow) < predict_2level(name, "ring", 2, 2, S, slow)
