"""torch.distributed's object collectives, built from ringzero's: a Python object travels as
its pickle, a uint8 tensor, padded to the largest one so every rank posts the same sizes.

    import primitives as P
    out = [None] * world_size
    P.all_gather_object(out, {"rank": rank})             # out[p] <- rank p's object
    P.broadcast_object_list(objs, src=0); P.gather_object(obj, out, dst=0)
    P.scatter_object_list(mine, objs if rank == 0 else None, src=0)

Cost: one all-gather of N int64 sizes, then the collective itself on N·max(size) bytes (what
torch does). Unpickling runs whatever the sender pickled: use it with ranks you trust.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from primitives.engine.algos import group_rank
from primitives.engine.api import all_gather, broadcast, gather, outside, scatter
from primitives.engine.registry import get_comm


def _encode(obj, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor, size: int):
    return pickle.loads(t[:size].cpu().numpy().tobytes())


def _root(comm, name: str, value, group_value) -> int:
    """The root's group rank from torch's pair (a global rank, or a group rank; neither: 0)."""
    if value is not None and group_value is not None:
        raise ValueError(f"rank {dist.get_rank()}: {name}: arguments src/dst = {value} and group_src/group_dst = "
                         f"{group_value} are both given; torch.distributed takes one of them")
    if group_value is not None:
        return group_value
    return group_rank(comm, 0 if value is None else value)


def _sizes(comm, group, nbytes: int) -> list[int]:
    """Every rank's byte count (one all_gather of N int64)."""
    mine = torch.tensor([nbytes], dtype=torch.int64, device=comm.device)
    every = [torch.zeros(1, dtype=torch.int64, device=comm.device) for _ in range(comm.size)]
    all_gather(every, mine, group)
    return [int(t.item()) for t in every]


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device=t.device)
    out[:t.numel()] = t
    return out


def all_gather_object(object_list, obj, group=None):
    """Like torch.distributed.all_gather_object: object_list[p] <- rank p's obj."""
    if outside(group, "all_gather_object"):
        return None
    comm = get_comm(group)
    mine = _encode(obj, comm.device)
    sizes = _sizes(comm, group, mine.numel())
    bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=comm.device) for _ in sizes]
    all_gather(bufs, _padded(mine, max(sizes)), group)
    for p, (b, s) in enumerate(zip(bufs, sizes)):
        object_list[p] = _decode(b, s)


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    """Like torch.distributed.broadcast_object_list: every rank's object_list <- the root's
    (same length everywhere). device: where the pickled bytes travel (default: the group's device)."""
    if outside(group, "broadcast_object_list"):
        return None
    comm = get_comm(group)
    root = _root(comm, "broadcast_object_list", src, group_src)
    dev = comm.device if device is None else torch.device(device)
    enc = [_encode(o, dev) for o in object_list] if comm.rank == root else []
    sizes = torch.tensor([e.numel() for e in enc] if enc else [0] * len(object_list), dtype=torch.int64, device=dev)
    broadcast(sizes, group=group, group_src=root)
    data = torch.cat(enc) if enc else torch.empty(int(sizes.sum()), dtype=torch.uint8, device=dev)
    broadcast(data, group=group, group_src=root)
    off = 0
    for i, s in enumerate(sizes.tolist()):
        object_list[i] = _decode(data[off:off + s], s)
        off += s


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    """Like torch.distributed.gather_object: on the root, object_gather_list[p] <- rank p's obj."""
    if outside(group, "gather_object"):
        return None
    comm = get_comm(group)
    root = _root(comm, "gather_object", dst, group_dst)
    if (comm.rank == root) != bool(object_gather_list):
        where = "must be given on the destination rank" if comm.rank == root else "must be None on other ranks"
        raise ValueError(f"rank {dist.get_rank()}: gather_object: argument 'object_gather_list' {where}")
    mine = _encode(obj, comm.device)
    sizes = _sizes(comm, group, mine.numel())
    bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=comm.device) for _ in sizes] if comm.rank == root else None
    gather(_padded(mine, max(sizes)), bufs, group=group, group_dst=root)
    if comm.rank == root:
        for p, (b, s) in enumerate(zip(bufs, sizes)):
            object_gather_list[p] = _decode(b, s)


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None, group=None,
                        group_src=None):
    """Like torch.distributed.scatter_object_list: scatter_object_output_list[0] <- the root's
    scatter_object_input_list[rank]."""
    if outside(group, "scatter_object_list"):
        return None
    comm = get_comm(group)
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError(f"rank {dist.get_rank()}: scatter_object_list: Expected argument "
                         f"scatter_object_output_list to be a list of size at least 1.")
    root = _root(comm, "scatter_object_list", src, group_src)
    enc = [_encode(o, comm.device) for o in scatter_object_input_list] if comm.rank == root else []
    top = torch.tensor([max((e.numel() for e in enc), default=0)], dtype=torch.int64, device=comm.device)
    broadcast(top, group=group, group_src=root)                 # the largest pickle: every rank's size
    size = torch.zeros(1, dtype=torch.int64, device=comm.device)
    scatter(size, [torch.tensor([e.numel()], device=comm.device) for e in enc] or None, group=group, group_src=root)
    buf = torch.empty(int(top.item()), dtype=torch.uint8, device=comm.device)
    scatter(buf, [_padded(e, int(top.item())) for e in enc] or None, group=group, group_src=root)
    scatter_object_output_list[0] = _decode(buf, int(size.item()))
