"""Column-, row- and vocab-parallel layers (Megatron-LM, arXiv 1909.08053 §3), built from an
existing unsharded module so pretrained weights load unchanged.

    python -m pytest -q tests/test_tensor_parallel.py -k layers

    Y = X·Aᵀ with A split by rows (output features) over ranks: ColumnParallelLinear
        rank r computes Y_r = X·A_rᵀ (its slice of the outputs), input via f (or ḡ with SP)
    Y = X·Bᵀ with B split by columns (input features): RowParallelLinear
        rank r computes X_r·B_rᵀ (a partial sum), output via g (or r̄ with SP), bias once after
    embedding rows split by vocabulary: VocabParallelEmbedding
        rank r looks up the ids it owns, zeros elsewhere, then g

Every layer takes the tensor-parallel `comm` (comm.py) at construction. Splits follow
torch.tensor_split (primitives/ops.py::chunk_bounds), so sizes need not divide by N; `unit`
keeps attention heads whole. Each sharded parameter carries `tp_shard = (dim, start, end,
full_size)` and Megatron's `tensor_model_parallel = True` (the marker DeepSpeed's gradient
norm reads).

Cost per forward, x of b·s·h elements: column-parallel none (f) or one all-gather (SP);
row-parallel one all-reduce (g) or one reduce-scatter (SP); the backward swaps them, and with
SP a column-parallel layer all-gathers its input once more for its weight gradient (it saved
only the sequence shard: comm.SeqParallelLinear).
Parameter bytes per rank: 1/N of the weight (+ the full bias for row-parallel).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from primitives.ops import chunk_bounds
from tensor_parallel.comm import copy_to_tp, gather_seq, linear_maybe_regather, reduce_from_tp, scatter_seq


class TPError(ValueError):
    """A model or argument tensor parallelism cannot use; raised identically on every rank."""


def shard_bounds(size: int, n: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of rank's slice of `size` elements, in whole `unit`s (chunk_bounds' rule)."""
    if size % unit:
        raise TPError(f"size {size} is not a whole number of units of {unit}")
    lo, hi = chunk_bounds(size // unit, n)[rank]
    return lo * unit, hi * unit


def _shard(param, dim: int, lo: int, hi: int, unit: int = 1) -> nn.Parameter:
    p = nn.Parameter(param.detach().narrow(dim, lo, hi - lo).clone(), requires_grad=param.requires_grad)
    p.tp_shard, p.tp_unit = (dim, lo, hi, param.shape[dim]), unit
    p.tensor_model_parallel = True   # Megatron's marker: DeepSpeed counts this in the norm on every tp rank
    return p


def _bounds(who: str, size: int, comm, unit: int) -> tuple[int, int]:
    if size // unit < comm.size:
        raise TPError(f"rank {comm.rank}: {who}: {size // unit} units (of {unit} features) cannot be split "
                      f"over tp={comm.size} ranks; every rank needs at least one")
    return shard_bounds(size, comm.size, comm.rank, unit)


class ColumnParallelLinear(nn.Module):
    """Output features split over the group. `input_comm=False` skips f/ḡ because the caller
    already applied it once for several layers sharing an input (Q, K and V)."""

    def __init__(self, linear: nn.Linear, comm, *, sequence_parallel=False, unit=1, input_comm=True, seq_dim=1):
        super().__init__()
        self.comm = comm
        lo, hi = self.bounds = _bounds("ColumnParallelLinear", linear.out_features, comm, unit)
        self.in_features, self.out_features, self.unit = linear.in_features, linear.out_features, unit
        self.weight = _shard(linear.weight, 0, lo, hi, unit)
        self.bias = _shard(linear.bias, 0, lo, hi, unit) if linear.bias is not None else None
        self.sequence_parallel, self.input_comm, self.seq_dim = sequence_parallel, input_comm, seq_dim

    def forward(self, x):
        if self.input_comm:
            x = (gather_seq(x, self.comm, self.seq_dim, regather=True) if self.sequence_parallel
                 else copy_to_tp(x, self.comm))
        return linear_maybe_regather(x, self.weight, self.bias)   # saves only the shard after ḡ

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features} → rows {self.bounds} on rank {self.comm.rank}/{self.comm.size}"


class RowParallelLinear(nn.Module):
    """Input features split over the group; x is this rank's slice (a ColumnParallelLinear's output)."""

    def __init__(self, linear: nn.Linear, comm, *, sequence_parallel=False, unit=1, seq_dim=1):
        super().__init__()
        self.comm = comm
        lo, hi = self.bounds = _bounds("RowParallelLinear", linear.in_features, comm, unit)
        self.in_features, self.out_features, self.unit = linear.in_features, linear.out_features, unit
        self.weight = _shard(linear.weight, 1, lo, hi, unit)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        if sequence_parallel and self.bias is not None:
            self.bias.tp_sequence_parallel = True      # added on a sequence slice: grads are partial

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = scatter_seq(y, self.comm, self.seq_dim) if self.sequence_parallel else reduce_from_tp(y, self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in={self.in_features} → cols {self.bounds}, out={self.out_features} on rank {self.comm.rank}/{self.comm.size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary id; output all-reduced (g), so it is replicated."""

    def __init__(self, emb: nn.Embedding, comm):
        super().__init__()
        self.comm = comm
        self.vocab_start, self.vocab_end = _bounds("VocabParallelEmbedding", emb.num_embeddings, comm, 1)
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.weight = _shard(emb.weight, 0, self.vocab_start, self.vocab_end)
        pad = emb.padding_idx
        self.padding_idx = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None

    def forward(self, ids):
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        e = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(e, self.comm)

    def extra_repr(self):
        return f"vocab {self.num_embeddings} → ids [{self.vocab_start}, {self.vocab_end}), dim {self.embedding_dim}"
