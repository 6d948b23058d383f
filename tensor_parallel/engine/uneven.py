"""Gathering and scattering the last dimension when its slices differ in size (shard_bounds'
uneven splits): all-gather needs equal blocks, so each slice is padded to the largest, gathered, trimmed.

    python -m pytest -q tests/test_tensor_parallel.py -k layers

gather_last_dim (a column-parallel output → the whole output), scatter_last_dim (a replicated input →
this rank's slice), each the other's backward; pad_gather, the plain all-gather for state dicts.
Cost: one all-gather of N·⌈full/N⌉ elements per row of x (at most N−1 padding elements more).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensor_parallel.comm import ALGORITHM
from tensor_parallel.layers import shard_bounds


def pad_gather(x: torch.Tensor, full: int, comm, unit: int = 1) -> torch.Tensor:
    """All-gather uneven slices of the last dim: pad each to the largest, gather, trim."""
    n = comm.size
    bounds = [shard_bounds(full, n, r, unit) for r in range(n)]
    width = max(hi - lo for lo, hi in bounds)
    xp = F.pad(x, (0, width - x.shape[-1])).movedim(-1, 0).contiguous()
    out = xp.new_empty((n * width,) + tuple(xp.shape[1:]))
    comm.all_gather_single(out, xp, algorithm=ALGORITHM["all_gather_single"])
    parts = out.view(n, width, *xp.shape[1:])
    return torch.cat([parts[r, :hi - lo] for r, (lo, hi) in enumerate(bounds)]).movedim(0, -1)


class LastDim(torch.autograd.Function):
    """gather: all-gather the last-dim slices (a column-parallel output → the whole output), else keep
    this rank's slice of a replicated input. Each is the other's adjoint: downstream of a gather every
    rank holds the same full gradient, so its backward keeps the slice; a slice's backward gathers."""

    @staticmethod
    def forward(ctx, x, full, comm, unit, gather: bool):
        ctx.args, ctx.gather = (full, comm, unit), gather
        return _gather_or_slice(x, full, comm, unit, gather)

    @staticmethod
    def backward(ctx, dy):
        return _gather_or_slice(dy, *ctx.args, not ctx.gather), None, None, None, None


def _gather_or_slice(x, full: int, comm, unit: int, gather: bool) -> torch.Tensor:
    if gather:
        return pad_gather(x, full, comm, unit) if comm.size > 1 else x
    lo, hi = shard_bounds(full, comm.size, comm.rank, unit)
    return x[..., lo:hi].contiguous()


def gather_last_dim(x, full: int, comm, unit: int = 1):
    return LastDim.apply(x, full, comm, unit, True)


def scatter_last_dim(x, full: int, comm, unit: int = 1):
    return LastDim.apply(x, full, comm, unit, False)
