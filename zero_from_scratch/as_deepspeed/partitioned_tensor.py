"""`deepspeed.runtime.utils.PartitionedTensor`: one tensor split into contiguous flat parts over a group.

    part = PartitionedTensor(full, group)            # each rank keeps its part (a clone) of full.view(-1)
    full_again = part.full()                         # gathered back; to_meta()/from_meta() carry the layout

As DeepSpeed's (runtime/utils.py): the split is DeepSpeed's partition_uniform over numel (the first
`numel % N` parts one element longer), the meta tensor is [ndim, *shape, N, rank, *bounds] (long),
full() all-gathers equal parts and broadcasts each part in turn when they differ. Cost: one
all-gather (or N broadcasts) of numel elements per full().
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """N + 1 bounds: parts of num_items // N, the first num_items % N one longer (DeepSpeed's split)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


class PartitionedTensor:

    def __init__(self, tensor, group, partition_meta=None):
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        lo, hi = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[lo:hi].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta, local_part, group, device="cpu"):
        assert meta.dtype == torch.long
        obj = cls(tensor=torch.ones(dist.get_world_size(group=group)), group=group)
        meta = meta.tolist()
        obj.orig_size = meta[1:1 + meta[0]]
        meta = meta[1 + meta[0]:]
        obj.orig_device, obj.local_data = device, local_part.detach()
        assert obj.num_parts == meta[0] and obj.rank == meta[1]
        obj.partition = meta[2:]
        obj.even_split = math.prod(obj.orig_size) % obj.num_parts == 0
        return obj

    def full(self, device=None):
        flat = torch.zeros(math.prod(self.orig_size), dtype=self.local_data.dtype, device=device or self.orig_device)
        if self.even_split:
            dist.all_gather_into_tensor(flat, self.local_data, group=self.group)
        else:
            for p in range(self.num_parts):
                buf = flat[self.partition[p]:self.partition[p + 1]]
                if p == self.rank:
                    buf.copy_(self.local_data)
                dist.broadcast(buf, dist.get_global_rank(self.group, p) if self.group is not None else p, self.group)
        return flat.view(self.orig_size).clone().detach()

    def to_meta(self):
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.LongTensor(meta).to(self.orig_device)

    def data(self):
        return self.local_data

    def local_size(self):
        return self.local_data.size()

    def full_size(self):
        return self.orig_size
