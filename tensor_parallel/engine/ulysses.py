"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509):
attention over a sequence split across ranks, by re-sharding heads ↔ sequence with all-to-all.

    python -m pytest -q tests/test_tensor_parallel.py -k ulysses

Every rank holds s/N positions and the whole (replicated) Q, K, V and output weights:
    q, k, v = x_r·W          [b, s/N, H, d]   my positions, every head
    all-to-all  ──────────►  [b, s, H/N, d]   every position, my heads     (one call for q, k, v)
    softmax(q·kᵀ/√d + mask)·v over the full sequence, for my heads
    all-to-all  ──────────►  [b, s/N, H, d]   back to my positions;  out = o·W_o
Unlike Megatron-SP the weights are not sharded: it is data parallelism along the sequence, so a hook
all-reduces each weight gradient (a partial sum over this rank's positions). Heads must divide by N.
Cost per rank and layer, forward (backward: the same two all-to-alls, reversed):
(N-1)/N · 4·b·(s/N)·h elements, falling with N, where TP's all-reduces send 2(N-1)/N·b·s·h.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from primitives.engine.registry import get_comm
from tensor_parallel.comm import all_reduce_grad
from tensor_parallel.layers import TPError


def _a2a(x: torch.Tensor, comm) -> torch.Tensor:
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x.contiguous())
    return out


class AllToAll(torch.autograd.Function):
    """to_heads: [..., b, s/N, H, d] → [..., b, s, H/N, d], else the inverse. All-to-all is a
    permutation of blocks, so its adjoint is the inverse permutation: the other direction."""

    @staticmethod
    def forward(ctx, x, comm, to_heads: bool):
        ctx.comm, ctx.to_heads = comm, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, comm)

    @staticmethod
    def backward(ctx, dy):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(dy, ctx.comm), None, None


def _seq_to_heads(x, comm):
    n = comm.size
    *lead, b, sl, H, d = x.shape
    blocks = x.reshape(*lead, b, sl, n, H // n, d).movedim(-3, 0)        # [N(dest), ..., b, s/N, H/N, d]
    got = _a2a(blocks, comm)                                             # [N(source = seq block), ...]
    return got.movedim(0, -4).reshape(*lead, b, n * sl, H // n, d)


def _heads_to_seq(x, comm):
    n = comm.size
    *lead, b, s, Hl, d = x.shape
    blocks = x.reshape(*lead, b, n, s // n, Hl, d).movedim(-4, 0)        # [N(dest = seq block), ...]
    got = _a2a(blocks, comm)                                             # [N(source = head block), ...]
    return got.movedim(0, -3).reshape(*lead, b, s // n, n * Hl, d)


class UlyssesAttention(nn.Module):
    """Multi-head self-attention on a sequence slice [b, s/N, h]; weights copied from
    `q, k, v, o` (nn.Linear h → h), so it can take over a pretrained attention block."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, n_heads: int, group=None):
        super().__init__()
        comm = get_comm(group)
        if n_heads % comm.size:
            raise TPError(f"rank {comm.rank}: UlyssesAttention: {n_heads} heads do not divide over {comm.size} "
                          "ranks (all-to-all gives every rank H/N whole heads)")
        self.comm, self.n_heads = comm, n_heads
        self.q, self.k, self.v, self.o = (copy.deepcopy(m) for m in (q, k, v, o))   # the caller's stay as they are
        for p in self.parameters():                 # each rank sees s/N positions: partial gradients
            p.register_hook(lambda g: all_reduce_grad(g, comm))

    def forward(self, x, key_mask=None):
        """x: [b, s/N, h] (this rank's positions); key_mask: [b, s] bool, True = attend (all ranks)."""
        b, sl, h = x.shape
        d = h // self.n_heads
        qkv = torch.stack([m(x) for m in (self.q, self.k, self.v)]).view(3, b, sl, self.n_heads, d)
        q, k, v = AllToAll.apply(qkv, self.comm, True).transpose(-2, -3).unbind(0)   # [b, H/N, s, d]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        ctx = (scores.softmax(-1) @ v).transpose(1, 2)                           # [b, s, H/N, d]
        return self.o(AllToAll.apply(ctx, self.comm, False).reshape(b, sl, h))

