"""`deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced`: ZeRO-2's gradient reduce-scatter
over several tensors in one collective, on ringzero's reduce_scatter_tensor.

    parts = reduce_scatter_coalesced([g1, g2], group)    (under the runner)

Each tensor is cut into world-size chunks of ceil(numel / N) (the last one short, padded); rank r's
chunks of every tensor are laid side by side, the whole buffer is divided by N first (DeepSpeed
pre-divides: the result is the mean), and one reduce-scatter leaves rank r its block. Returned: one
view per tensor, this rank's chunk unpadded. As DeepSpeed's, a single tensor whose size N divides is
divided in place. Cost: one reduce-scatter of Σ ceil(numel/N)·N elements, (N-1)/N of it sent per rank.
"""
from __future__ import annotations

import math

import torch

from zero_from_scratch.as_deepspeed import comm


def reduce_scatter_coalesced(tensors, group=None):
    rank, n = comm.get_rank(group), comm.get_world_size(group)
    chunk = [math.ceil(t.numel() / n) for t in tensors]
    pieces = [[t.view(-1)[r * c:(r + 1) * c] for r in range(n)] for t, c in zip(tensors, chunk)]
    if len(tensors) == 1 and tensors[0].numel() % n == 0:
        flat = tensors[0].view(-1)
    else:
        flat = torch.cat([x for r in range(n) for i, c in enumerate(chunk)
                          for x in (pieces[i][r], pieces[i][r].new_empty(c - pieces[i][r].numel()))])
    flat.div_(n)
    blocks = torch.chunk(flat, n)
    comm.reduce_scatter_tensor(blocks[rank], flat, group=group)
    out, offset = [], 0
    for i, c in enumerate(chunk):
        out.append(blocks[rank].narrow(0, offset, pieces[i][rank].numel()))
        offset += c
    return out
