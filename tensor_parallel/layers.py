"""Column-, row- and vocab-parallel layers (Megatron-LM, arXiv 1909.08053 §3), built from an
existing unsharded module so pretrained weights load unchanged.

    python -m pytest -q tests/test_tensor_parallel.py -k layers

    Y = X·Aᵀ with A split by rows (output features) over ranks: ColumnParallelLinear
        rank r computes Y_r = X·A_rᵀ (its slice of the outputs), input via f (or ḡ with SP)
    Y = X·Bᵀ with B split by columns (input features): RowParallelLinear
        rank r computes X_r·B_rᵀ (a partial sum), output via g (or r̄ with SP), bias once after
    embedding rows split by vocabulary: VocabParallelEmbedding
        rank r looks up the ids it owns, zeros elsewhere, then g

Splits follow torch.tensor_split (the first `size % N` ranks get one more unit), so sizes need
not divide by N; `unit` keeps attention heads whole. Each sharded parameter carries
`tp_shard = (dim, start, end, full_size)`; gather_state_dict and the tests read it. It also
carries Megatron's `tensor_model_parallel = True`, the one marker DeepSpeed's gradient norm reads.

Cost per forward, x of b·s·h elements: column-parallel none (f) or one all-gather (SP);
row-parallel one all-reduce (g) or one reduce-scatter (SP); the backward swaps them, and with
SP a column-parallel layer all-gathers its input once more for its weight gradient (it saved
only the sequence shard: comm.SeqParallelLinear).
Parameter bytes per rank: 1/N of the weight (+ the full bias for row-parallel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import primitives as P
from tensor_parallel import comm as C


class TPError(ValueError):
    """A model or argument tensor parallelism cannot use; raised identically on every rank."""


def shard_bounds(size: int, n: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of rank's slice of `size` elements, in whole `unit`s, torch.tensor_split's rule."""
    if size % unit:
        raise TPError(f"size {size} is not a whole number of units of {unit}")
    units = size // unit
    q, r = divmod(units, n)
    start = rank * q + min(rank, r)
    return start * unit, (start + q + (rank < r)) * unit


def _comm(group, what: str):
    try:
        return P.get_comm(group)
    except ValueError as e:
        raise TPError(f"{what}: {e} (every rank that calls a parallel layer must be in its group)") from None


def _shard(param: torch.Tensor, dim: int, lo: int, hi: int, unit: int = 1) -> nn.Parameter:
    p = nn.Parameter(param.detach().narrow(dim, lo, hi - lo).clone(), requires_grad=param.requires_grad)
    p.tp_shard, p.tp_unit = (dim, lo, hi, param.shape[dim]), unit
    p.tensor_model_parallel = True   # Megatron's marker: DeepSpeed counts this in the norm on every tp rank
    return p


class ColumnParallelLinear(nn.Module):
    """Output features split over the group. `gather_output=True` all-gathers the result (for a
    layer whose consumer is not row-parallel); `input_comm=False` skips f/ḡ because the caller
    already applied it once for several layers sharing an input (Q, K and V)."""

    def __init__(self, linear: nn.Linear, group=None, *, gather_output=False, sequence_parallel=False,
                 unit=1, input_comm=True, seq_dim=1):
        super().__init__()
        comm = _comm(group, "ColumnParallelLinear")
        self.group, self.n, self.rank = group, comm.size, comm.rank
        out = linear.out_features
        if out // unit < self.n:
            raise TPError(f"rank {self.rank}: ColumnParallelLinear: {out // unit} output units (of {unit} features) cannot be "
                          f"split over tp={self.n} ranks; every rank needs at least one")
        lo, hi = shard_bounds(out, self.n, self.rank, unit)
        self.in_features, self.out_features, self.bounds = linear.in_features, out, (lo, hi)
        self.weight = _shard(linear.weight, 0, lo, hi, unit)
        self.bias = _shard(linear.bias, 0, lo, hi, unit) if linear.bias is not None else None
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.input_comm, self.seq_dim, self.unit = input_comm, seq_dim, unit

    def forward(self, x):
        if self.input_comm:
            x = (C.gather_seq(x, self.seq_dim, self.group, regather=True) if self.sequence_parallel
                 else C.copy_to_tp(x, self.group))
        y = C.linear_maybe_regather(x, self.weight, self.bias)   # saves only the shard after ḡ
        return gather_last_dim(y, self.out_features, self.group, self.unit) if self.gather_output else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features} → rows {self.bounds} on rank {self.rank}/{self.n}"


class RowParallelLinear(nn.Module):
    """Input features split over the group. `input_is_parallel=True`: x is already this rank's
    slice (the output of a ColumnParallelLinear); otherwise the layer takes its slice itself."""

    def __init__(self, linear: nn.Linear, group=None, *, input_is_parallel=True, sequence_parallel=False,
                 unit=1, seq_dim=1):
        super().__init__()
        comm = _comm(group, "RowParallelLinear")
        self.group, self.n, self.rank = group, comm.size, comm.rank
        inp = linear.in_features
        if inp // unit < self.n:
            raise TPError(f"rank {self.rank}: RowParallelLinear: {inp // unit} input units cannot be split over tp={self.n} ranks")
        lo, hi = shard_bounds(inp, self.n, self.rank, unit)
        self.in_features, self.out_features, self.bounds = inp, linear.out_features, (lo, hi)
        self.weight = _shard(linear.weight, 1, lo, hi, unit)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = input_is_parallel, sequence_parallel, seq_dim
        self.unit = unit
        if sequence_parallel and self.bias is not None:
            self.bias.tp_sequence_parallel = True      # added on a sequence slice: grads are partial

    def forward(self, x):
        if not self.input_is_parallel:
            x = ScatterLastDim.apply(x, self.bounds, self.group, self.unit)
        y = F.linear(x, self.weight)
        y = C.scatter_seq(y, self.seq_dim, self.group) if self.sequence_parallel else C.reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in={self.in_features} → cols {self.bounds}, out={self.out_features} on rank {self.rank}/{self.n}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary id; output all-reduced (g), so it is replicated."""

    def __init__(self, emb: nn.Embedding, group=None):
        super().__init__()
        comm = _comm(group, "VocabParallelEmbedding")
        self.group, self.n, self.rank = group, comm.size, comm.rank
        v = emb.num_embeddings
        if v < self.n:
            raise TPError(f"rank {self.rank}: VocabParallelEmbedding: vocabulary of {v} cannot be split over tp={self.n} ranks")
        self.vocab_start, self.vocab_end = shard_bounds(v, self.n, self.rank)
        self.num_embeddings, self.embedding_dim = v, emb.embedding_dim
        self.weight = _shard(emb.weight, 0, self.vocab_start, self.vocab_end)
        pad = emb.padding_idx
        self.padding_idx = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None

    def forward(self, ids):
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        e = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return C.reduce_from_tp(e, self.group)

    def extra_repr(self):
        return f"vocab {self.num_embeddings} → ids [{self.vocab_start}, {self.vocab_end}), dim {self.embedding_dim}"


def _pad_gather(x: torch.Tensor, full: int, group, unit: int = 1) -> torch.Tensor:
    """All-gather uneven slices of the last dim: pad each to the largest, gather, trim."""
    comm = P.get_comm(group)
    n = comm.size
    bounds = [shard_bounds(full, n, r, unit) for r in range(n)]
    width = max(hi - lo for lo, hi in bounds)
    xp = F.pad(x, (0, width - x.shape[-1])).movedim(-1, 0).contiguous()
    out = torch.empty((n * width,) + tuple(xp.shape[1:]), dtype=x.dtype)
    P.all_gather_single(out, xp, group=group, algorithm=C.ALGORITHM["all_gather_single"])
    parts = out.view(n, width, *xp.shape[1:])
    return torch.cat([parts[r, :hi - lo] for r, (lo, hi) in enumerate(bounds)]).movedim(0, -1)


class GatherLastDim(torch.autograd.Function):
    """Forward: all-gather the last-dim slices. Backward: each rank keeps its slice (downstream
    is replicated, so every rank holds the same full gradient)."""

    @staticmethod
    def forward(ctx, x, full, group, unit):
        comm = P.get_comm(group)
        ctx.bounds = shard_bounds(full, comm.size, comm.rank, unit)
        return _pad_gather(x, full, group, unit) if comm.size > 1 else x

    @staticmethod
    def backward(ctx, dy):
        lo, hi = ctx.bounds
        return dy[..., lo:hi].contiguous(), None, None, None


class ScatterLastDim(torch.autograd.Function):
    """Forward: keep this rank's slice of a replicated input. Backward: all-gather the slices."""

    @staticmethod
    def forward(ctx, x, bounds, group, unit):
        ctx.full, ctx.group, ctx.unit = x.shape[-1], group, unit
        return x[..., bounds[0]:bounds[1]].contiguous()

    @staticmethod
    def backward(ctx, dy):
        n = P.get_comm(ctx.group).size
        return (_pad_gather(dy, ctx.full, ctx.group, ctx.unit) if n > 1 else dy), None, None, None


def gather_last_dim(x, full: int, group=None, unit: int = 1):
    return GatherLastDim.apply(x, full, group, unit)
