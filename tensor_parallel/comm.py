"""The communication of tensor parallelism, as autograd functions over a `comm`'s collectives.

    python -m pytest -q tests/test_tensor_parallel.py -k operators

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053, §3) needs only a conjugate pair:

    f  = copy_to_tp       forward: identity              backward: all-reduce
    g  = reduce_from_tp   forward: all-reduce            backward: identity

and Megatron-SP (Korthikanti et al. 2022, arXiv 2205.05198, §4.2) replaces them, where the
activations between two TP regions are split along the sequence, by the pair

    ḡ  = gather_seq       forward: all-gather (seq)      backward: reduce-scatter (seq)
    r̄  = scatter_seq      forward: reduce-scatter (seq)  backward: all-gather (seq)

Cost per call, x of b·s·h elements (ring algorithms, N = tp ranks, 4-byte floats):
    f, g        one all-reduce of b·s·h:            2(N-1)/N·b·s·h·4 bytes sent per rank
    ḡ, r̄        one all-gather / reduce-scatter:     (N-1)/N·b·s·h·4 bytes sent per rank
so a ḡ + r̄ pair sends exactly what one all-reduce sends (a ring all-reduce IS a reduce-scatter
followed by an all-gather). Like Megatron-SP, the column-parallel layers after ḡ save only the
sequence shard for their weight gradient and all-gather it once more in backward (Regather,
SeqParallelLinear): one extra all-gather of b·s·h/N per rank per ḡ, for s/N instead of s
positions of saved input. So SP costs 6 all-gathers + 4 reduce-scatters per layer (1.25× plain
TP's bytes) and saves activation memory.

`comm` is any object with the collective methods all_reduce / all_gather_single /
reduce_scatter_single and `rank`, `size` (primitives/comm.py's Communicator). ALGORITHM picks
which of its algorithms runs ("auto" = the α-β model's choice; tests pin "ring" to check formulas).
"""
from __future__ import annotations

import torch

ALGORITHM = {"all_reduce": "auto", "all_gather_single": "auto", "reduce_scatter_single": "auto"}


def _all_reduce(x: torch.Tensor, comm) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, "sum", algorithm=ALGORITHM["all_reduce"])
    return out


def _gather(x: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """All-gather equal blocks along `dim` (rank order)."""
    if comm.size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = x.new_empty((comm.size * moved.shape[0],) + tuple(moved.shape[1:]))
    comm.all_gather_single(out, moved, algorithm=ALGORITHM["all_gather_single"])
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """Sum over ranks, keep block `rank` of `dim` (which must divide by N)."""
    if comm.size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = x.new_empty((moved.shape[0] // comm.size,) + tuple(moved.shape[1:]))
    comm.reduce_scatter_single(out, moved, "sum", algorithm=ALGORITHM["reduce_scatter_single"])
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, comm) -> torch.Tensor:
    return x.chunk(comm.size, dim)[comm.rank].contiguous() if comm.size > 1 else x


class CopyToTP(torch.autograd.Function):
    """f: y = x on every rank. Each rank then uses y only through its own shard of the next
    weights, so L = Σ_r L_r(y) and ∂L/∂x = Σ_r ∂L_r/∂y: the backward is an all-reduce."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.comm), None


class ReduceFromTP(torch.autograd.Function):
    """g: y = Σ_r x_r (the partial products of a row-parallel layer). ∂y/∂x_r = I for every r,
    and downstream of y every rank computes the same thing, so ∂L/∂x_r = ∂L/∂y: identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class GatherSeq(torch.autograd.Function):
    """ḡ: y = [x_0; …; x_{N-1}] along the sequence. Rank r's x_r feeds every rank's shard of
    the next weights, so ∂L/∂x_r = Σ_q (∂L_q/∂y)[block r]: a reduce-scatter. It runs after
    every consumer of y has sent its gradient, so it also frees a Regather's copy."""

    @staticmethod
    def forward(ctx, x, dim, comm, regather):
        ctx.dim, ctx.comm, ctx.regather = dim, comm, regather
        return _gather(x, dim, comm)

    @staticmethod
    def backward(ctx, dy):
        if ctx.regather is not None:
            ctx.regather.full = None
        return _reduce_scatter(dy, ctx.dim, ctx.comm), None, None, None


class ScatterSeq(torch.autograd.Function):
    """r̄: y_r = (Σ_q x_q)[block r]. ∂y_r/∂x_q[block r] = I, and block r's gradient lives on
    rank r only, so every rank needs every block of ∂L/∂y: an all-gather."""

    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _reduce_scatter(x, dim, comm)

    @staticmethod
    def backward(ctx, dy):
        return _gather(dy, ctx.dim, ctx.comm), None, None


class Regather:
    """The gathered input of ḡ, rebuilt in backward from the shard instead of kept: the first
    column-parallel layer whose weight gradient needs it all-gathers (one all-gather of
    b·s·h/N per rank), the others (K and V after Q) reuse it, ḡ's backward drops it."""

    def __init__(self, shard: torch.Tensor, dim: int, comm):
        self.shard, self.dim, self.comm, self.full = shard.detach(), dim, comm, None

    def get(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = _gather(shard, self.dim, self.comm)
        return self.full


class SeqParallelLinear(torch.autograd.Function):
    """y = x·Wᵀ + b for x = ḡ(shard), saving the shard (s/N positions), not x (s positions):
    ∂L/∂x = ∂L/∂y·W needs no x; ∂L/∂W = (∂L/∂y)ᵀ·x needs x, all-gathered again (Regather)."""

    @staticmethod
    def forward(ctx, x, weight, bias, regather):
        ctx.regather, ctx.has_bias = regather, bias is not None
        ctx.save_for_backward(regather.shard, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        shard, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = db = None
        if ctx.needs_input_grad[1]:
            x = ctx.regather.get(shard)
            dw = dy2.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None


class SplitSeq(torch.autograd.Function):
    """Enter a sequence-parallel region from a replicated one: y_r = x[block r]. Upstream is
    replicated, so every rank needs the whole ∂L/∂x: backward all-gathers."""

    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _split(x, dim, comm)

    @staticmethod
    def backward(ctx, dy):
        return _gather(dy, ctx.dim, ctx.comm), None, None


class GatherSeqToReplicated(torch.autograd.Function):
    """Leave a sequence-parallel region into a replicated one: y = all-gather(x). Downstream
    every rank computes the same function of y with the same ∂L/∂y, so rank r's gradient is
    just its own block (no communication; summing would count it N times)."""

    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _gather(x, dim, comm)

    @staticmethod
    def backward(ctx, dy):
        return _split(dy, ctx.dim, ctx.comm), None, None


def copy_to_tp(x, comm):
    return CopyToTP.apply(x, comm)


def reduce_from_tp(x, comm):
    return ReduceFromTP.apply(x, comm)


def gather_seq(x, comm, dim=1, regather=False):
    """ḡ. regather=True: the result carries `tp_regather`, which column-parallel layers use to
    save only x's shard (SeqParallelLinear): Megatron-SP's memory layout."""
    if not regather or not torch.is_grad_enabled():
        return GatherSeq.apply(x, dim, comm, None)
    handle = Regather(x, dim, comm)
    y = GatherSeq.apply(x, dim, comm, handle)
    y.tp_regather = handle
    return y


def scatter_seq(x, comm, dim=1):
    return ScatterSeq.apply(x, dim, comm)


def split_seq(x, comm, dim=1):
    return SplitSeq.apply(x, dim, comm)


def gather_seq_to_replicated(x, comm, dim=1):
    return GatherSeqToReplicated.apply(x, dim, comm)


def linear_maybe_regather(x, weight, bias):
    """F.linear, or SeqParallelLinear when x came from gather_seq(..., regather=True)."""
    handle = getattr(x, "tp_regather", None)
    if handle is None:
        return torch.nn.functional.linear(x, weight, bias)
    return SeqParallelLinear.apply(x, weight, bias, handle)


def all_reduce_grad(grad: torch.Tensor, comm) -> torch.Tensor:
    """Sum a parameter gradient over the TP group (a hook for parameters that see only a slice
    of the sequence: LayerNorms and row-parallel biases under SP, every weight under Ulysses)."""
    return _all_reduce(grad, comm)
