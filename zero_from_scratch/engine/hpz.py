"""ZeRO++ hierarchical weight partitioning (hpZ, arXiv 2306.10209 §3.2): a secondary copy of each
ZeRO-3 weight unit, partitioned inside a group of k consecutive ranks (one node), so the
backward all-gather never crosses the slow link.

    {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}      # k = ranks per node
    python -m multinode run -- torchrun --nnodes 2 --nproc_per_node 2 ... (tests/test_multinode_hpz.py)

Per micro-batch, for a unit of Ψ elements (s = Ψ/N, N = m·k ranks, m nodes):
  forward   all-gather over all N ranks (algorithm "auto": hierarchical across nodes), then keep
            this rank's 1/k slice of the gathered unit: the secondary shard (Ψ/k elements)
  backward  all-gather of the secondary shards inside the group only: (k-1)·Ψ/k intra-node,
            0 inter-node bytes (plain ZeRO-3 all-gathers across the world again here)
  reduce    reduce-scatter over all N ranks ("auto"), then the secondary shard is freed
Inter-node bytes a node sends per micro-batch (hierarchical collectives): 2·k(m-1)·s with hpZ
vs 3·k(m-1)·s without; vs a flat ring, where one rank per node forwards everything, 3(N-1)·s.
Memory: + Ψ/k per rank between a unit's forward and its reduce-scatter. The secondary copy is
only valid until the optimizer step (the shards change); it is refreshed by the next forward.
With qwZ (qwz.py) the forward all-gather moves int8 codes + scales, and the secondary shard is
this rank's 1/k slice of *those bytes*: (1 + 4/B)·Ψ/k bytes instead of 4Ψ/k, the backward
all-gather inside the group moves int8 too, and backward sees bit for bit the weights forward
saw. (DeepSpeed keeps the secondary in the weights' dtype, copied from the dequantised forward
weights, and quantises it again for the group all-gather: a second rounding, other blocks.)
The group all-gather is filed in the ledger as "param all-gather (backward, hpZ group)". Under
overlap_comm the prefetches do the same: a forward prefetch keeps the slice when it is waited
for, a backward prefetch gathers inside the group (stage3.py, qwz.py).
With offload_param "cpu" the secondary shards stay in host memory, where DeepSpeed puts them
(_partition_param_sec allocates them on the offload device); "nvme" is refused (not in files here).
Needs comm_impl="primitives" (the group is a primitives view, not a torch process group).
"""
from __future__ import annotations

import functools

import torch

import primitives as P
from primitives.engine.subcomm import SubComm


def check_config(zero, world_size: int) -> None:
    """Reject what hpZ cannot do, at start-up, with what was expected."""
    k = zero.zero_hpz_partition_size
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"config key 'zero_optimization.zero_hpz_partition_size' is {k!r}; allowed: an int >= 1")
    if k > 1 and zero.stage != 3:
        raise ValueError(f"config key 'zero_optimization.zero_hpz_partition_size' is {k} but stage is {zero.stage}; "
                         "hpZ partitions ZeRO-3 weights: allowed with stage 3 only (or 1 = off)")
    if k > 1 and world_size % k:
        raise ValueError(f"config key 'zero_optimization.zero_hpz_partition_size' is {k}, which does not divide "
                         f"the world size {world_size}; allowed: a divisor (the ranks per node)")


class HpZ:
    def __init__(self, engine, k: int):
        if engine.comm.impl != "primitives":
            raise ValueError("zero_hpz_partition_size > 1 needs comm_impl='primitives'")
        world = P.get_comm()
        start = world.rank // k * k
        self.k, self.j = k, world.rank - start
        self.group = SubComm(world, list(range(start, start + k)))    # k consecutive ranks: one node
        self.secondary: dict[int, torch.Tensor] = {}
        self.comm = engine.comm
        # the world collectives go topology-aware too ("auto" = hierarchical across nodes)
        engine.comm._ag = functools.partial(P.all_gather_single, algorithm="auto")
        engine.comm._rs = functools.partial(P.reduce_scatter_single, algorithm="auto")

    def has(self, u, kind: str) -> bool:
        """Can the group's secondary shards serve this gather (a backward after a kept forward)?"""
        return kind == "backward" and u.index in self.secondary

    def gather(self, u, kind: str, full: torch.Tensor, tag: int, async_op: bool = False):
        """Backward: fill `full` (what the forward all-gather received: the unit, or qwZ's bytes)
        from the group's secondary shards. None = do the world all-gather; otherwise True, or with
        async_op (a prefetch) the handle."""
        if not self.has(u, kind):
            return None
        sec = self.secondary[u.index]
        b = full.numel() * full.element_size()
        h = self.comm.composed("param all-gather (backward, hpZ group)", "all_gather", b, (self.k - 1) * b // self.k,
                               lambda: P.all_gather_single(full, sec, group=self.group, algorithm="ring", tag=tag),
                               what=u.tag, async_op=async_op)
        return h if async_op else True

    def keep(self, u, full: torch.Tensor) -> None:
        """After the world all-gather of a training forward: keep my 1/k slice of what it received
        (N equal pieces, one per rank, and k divides N: the slice is N/k whole pieces)."""
        if torch.is_grad_enabled():
            ps = full.numel() // self.k
            self.secondary[u.index] = full[self.j * ps:(self.j + 1) * ps].clone()

    def release(self, u) -> None:
        self.secondary.pop(u.index, None)

    def clear(self) -> None:
        self.secondary.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.secondary.values())


def make(engine):
    k = engine.config.zero.zero_hpz_partition_size
    return HpZ(engine, k) if k > 1 else None
