"""Coalesced all-reduce: many tensors in one collective (torch.distributed's all_reduce_coalesced).

    python -m pytest -q tests/test_primitives_units.py -k coalesced

Every all-reduce pays its latency α per message: k tensors all-reduced one by one cost
k·2(N−1)α + 2(N−1)/N·Sβ on a ring; copied into one flat buffer first, 2(N−1)α + 2(N−1)/N·Sβ
plus two local copies of S bytes. This is the flat data-parallel gradient sync (ddp_examples/flat.py
keeps the gradients as views of one buffer instead, and skips the copies).
"""
import torch


def all_reduce_coalesced(comm, tensors, op="sum"):
    """All-reduce every tensor of `tensors` in place, through one flat buffer and one all-reduce."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, op)
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()
