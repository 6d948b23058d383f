"""Same starting point on every rank: broadcast rank 0's parameters and buffers, or check them.

Data parallelism only averages gradients: ranks that start from different weights stay different.
torch DDP broadcasts rank 0's state at construction; so do our wrappers (init_sync="broadcast"), or
they raise before training (init_sync="check"). Every buffer made here lives on the module's one
device (module_device). Cost: one broadcast of all parameters and buffers, Ψ·e bytes per dtype group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import primitives as P

MODES = ("broadcast", "check", "none")


def module_device(module: nn.Module, comm, who: str = "DataParallel") -> torch.device:
    """The one device every parameter and buffer of `module` lives on; every buffer a wrapper
    makes goes there too. Mixed devices (or a device the backend cannot move: gloo and MPI
    move CPU tensors, nccl CUDA ones) are refused with the names of the tensors on each."""
    where: dict = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        where.setdefault(t.device, []).append(name)
    if len(where) > 1:
        detail = "; ".join(f"{dev}: {names[:3]}{' …' if len(names) > 3 else ''}" for dev, names in where.items())
        raise ValueError(f"rank {comm.rank}: {who}: the module's parameters and buffers are on "
                         f"{len(where)} devices ({detail}); move the whole module to one device "
                         f"(module.to(device)) before wrapping it")
    device = next(iter(where), comm.device)
    if device.type != comm.device.type:
        raise ValueError(f"rank {comm.rank}: {who}: the module is on {device} but backend {comm.backend} "
                         f"moves {comm.device.type} tensors; move it with module.to({str(comm.device.type)!r}) "
                         "or launch with the matching backend (nccl for CUDA, gloo for CPU)")
    return device


def sync_initial_state(module: nn.Module, comm, mode: str = "broadcast", who: str = "DataParallel",
                       group=None) -> list[str]:
    """Make every rank's parameters and buffers equal to rank 0's (mode "broadcast") or raise
    on every rank if any differ (mode "check"). Returns the names that differed on this rank.
    Must be called on all ranks of the group (it communicates)."""
    if mode not in MODES:
        raise ValueError(f"rank {comm.rank}: {who}: init_sync must be one of {MODES}, got {mode!r}")
    device = module_device(module, comm, who)
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
        P.broadcast(theirs, _first(group), group)  # numel/dtype mismatches raise here, on every rank
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
        flags = torch.zeros(comm.size, dtype=torch.int32, device=device)
        flags[comm.rank] = int(bool(differ))
        P.all_reduce(flags, P.ReduceOp.SUM, group)   # every rank learns who differs, so all raise
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        if bad:
            what = (f"this rank's {differ}" if differ else "their parameters (their own error names them)")
            raise ValueError(f"rank {comm.rank}: {who}: parameters differ across ranks before training: "
                             f"rank(s) {bad} differ from rank 0 in {what}. Seed the model identically on "
                             "every rank, or use init_sync='broadcast' to copy rank 0's values")
    return differ


def _first(group) -> int:
    """The global rank of the group's rank 0 (broadcast's src is a global rank, like torch's)."""
    if group is None or not isinstance(group, dist.ProcessGroup):
        return 0
    return dist.get_global_rank(group, 0)
