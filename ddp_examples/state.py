"""Same starting point on every rank: broadcast rank 0's parameters and buffers, or check them.

Data parallelism only averages gradients; if the ranks start from different weights they
stay different forever (each applies the same averaged update to its own weights). torch DDP
broadcasts rank 0's state at construction; so do our wrappers (init_sync="broadcast"), or
they raise before training when asked to only check (init_sync="check").

Cost: one broadcast of all parameters and buffers, Ψ·e bytes per dtype group (ring broadcast:
every rank but the last sends about Ψ·e bytes).
"""
from __future__ import annotations

import torch
import torch.nn as nn

import primitives as P

MODES = ("broadcast", "check", "none")


def sync_initial_state(module: nn.Module, comm, mode: str = "broadcast", who: str = "DataParallel",
                       group=None) -> list[str]:
    """Make every rank's parameters and buffers equal to rank 0's (mode "broadcast") or raise
    on every rank if any differ (mode "check"). Returns the names that differed on this rank.
    Must be called on all ranks of the group (it communicates)."""
    if mode not in MODES:
        raise ValueError(f"rank {comm.rank}: {who}: init_sync must be one of {MODES}, got {mode!r}")
    if mode == "none" or comm.size == 1:
        return []
    named = list(module.named_parameters()) + list(module.named_buffers())
    by_dtype: dict = {}
    for name, t in named:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    differ = []
    for dtype, items in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        mine = torch.cat([t.detach().reshape(-1) for _, t in items])
        theirs = mine.clone()
        P.broadcast(theirs, 0, group)          # numel/dtype mismatches raise here, on every rank
        off = 0
        for name, t in items:
            n = t.numel()
            if not torch.equal(theirs[off:off + n], mine[off:off + n]):
                differ.append(name)
                if mode == "broadcast":
                    with torch.no_grad():
                        t.copy_(theirs[off:off + n].view_as(t))
            off += n
    if mode == "check":
        flags = torch.zeros(comm.size, dtype=torch.int32)
        flags[comm.rank] = int(bool(differ))
        P.all_reduce(flags, P.ReduceOp.SUM, group)   # every rank learns who differs, so all raise
        bad = [r for r in range(comm.size) if flags[r]]
        if bad:
            what = (f"this rank's {differ}" if differ else "their parameters (their own error names them)")
            raise ValueError(f"rank {comm.rank}: {who}: parameters differ across ranks before training: "
                             f"rank(s) {bad} differ from rank 0 in {what}. Seed the model identically on "
                             "every rank, or use init_sync='broadcast' to copy rank 0's values")
    return differ
