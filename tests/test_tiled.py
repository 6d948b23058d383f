"""TiledLinear (zero_from_scratch/as_deepspeed/tiled.py, DeepSpeed's runtime/zero/tiling.py) against one torch Linear.

    python -m pytest -q tests/test_tiled.py

Reference: a single nn.Linear with the same weights, in one process. One process, float64: every tile
grid (uneven splits included, bias on or off, the (output, bias)-returning variant) gives the
Linear's output and, cut into tiles, its gradients; tiles are copies of the Linear's blocks.
Two ranks at ZeRO-3: the TiledLinear is built inside zero.Init (each tile partitioned on its
own; copy_params_from writes through GatheredParameters with modifier_rank=0: rank 1 passes a
perturbed Linear and gets rank 0's values), trained by the ZeRO-3 engine with SGD; each rank's
output equals the reference (rank 0's Linear) on its batch, the averaged gradient of every tile's
weight and of each row's bias equals the reference's gradient of both ranks' batches, cut to the
tile, and so do the weights and biases after a step.
Tolerances: a row of tiles sums the same products as the Linear, in another order, so the two differ
by rounding only: 1e-12 in float64; at ZeRO-3 in fp32, 1e-5 (dot products of ≤ 23 terms of O(1),
eps 6e-8, and the reference's loss averaged over ranks in another order than the engine's reduction).
"""
import copy

import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch.as_deepspeed.tiled import TiledLinear, TiledLinearReturnBias
from zero_from_scratch.engine.safe_api import safe_get_full_fp32_param, safe_get_full_grad
from zero_from_scratch.engine.zero_init import Init

TOL64 = dict(rtol=1e-12, atol=1e-12)
TOL = dict(rtol=1e-5, atol=1e-5)


def _blocks(tiled, full: torch.Tensor):
    """(tile, the reference's block of `full` for that tile's weight)."""
    for o, row in enumerate(tiled.linears):
        for i, tile in enumerate(row):
            yield tile, full[tiled.out_parts[o]:tiled.out_parts[o + 1], tiled.in_parts[i]:tiled.in_parts[i + 1]]


class ReturnsBias(nn.Linear):
    """Megatron-LM's Linear: (x W^T, bias), the bias added later by the caller."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight), self.bias


@pytest.mark.parametrize("in_f,out_f,splits,bias", [(23, 29, (2, 3), True), (29, 23, (5, 1), False),
                                                     (8, 8, (8, 8), True), (16, 12, (1, 1), True)])
def test_tiles_equal_one_linear_forward_and_gradients(in_f, out_f, splits, bias):
    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f, bias=bias, dtype=torch.float64)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=splits[0], out_splits=splits[1], init_linear=base,
                        dtype=torch.float64)                 # kwargs reach every tile, as DeepSpeed's
    x = torch.randn(4, 3, in_f, dtype=torch.float64)
    ref, out = base(x), tiled(x)
    torch.testing.assert_close(out, ref, **TOL64)
    (ref * ref).sum().backward()
    (out * out).sum().backward()
    for (tile, w), (_, g) in zip(_blocks(tiled, base.weight), _blocks(tiled, base.weight.grad)):
        assert torch.equal(tile.weight, w)
        torch.testing.assert_close(tile.weight.grad, g, **TOL64)
    for o, row in enumerate(tiled.linears):
        assert all(t.bias is None for t in row[:-1]) and (row[-1].bias is not None) == bias
        if bias:
            torch.testing.assert_close(row[-1].bias.grad, base.bias.grad[tiled.out_parts[o]:tiled.out_parts[o + 1]],
                                       **TOL64)


def test_split_input_uncombined_output_and_returned_bias():
    torch.manual_seed(1)
    base = nn.Linear(10, 6)
    x = torch.randn(2, 10)
    tiled = TiledLinear(10, 6, in_splits=2, out_splits=2, input_is_already_split=True, combine_out_splits=False,
                        init_linear=base)
    outs = tiled(list(x.split([5, 5], dim=-1)))
    torch.testing.assert_close(torch.cat(outs, -1), base(x), **TOL)
    rb = ReturnsBias(10, 6)
    t, b = TiledLinearReturnBias(10, 6, in_splits=3, out_splits=2, linear_cls=ReturnsBias, init_linear=rb)(x)
    torch.testing.assert_close(t, nn.functional.linear(x, rb.weight), **TOL)
    assert torch.equal(b, rb.bias)
    with pytest.raises(RuntimeError, match="in splits"):
        TiledLinear(4, 4, in_splits=5)


CFG = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_allow_untested_optimizer": True,
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _zero3(rank, world):
    torch.manual_seed(0)
    base = nn.Linear(23, 29)                                  # the same on every rank (same seed)
    mine = copy.deepcopy(base)
    if rank != 0:                                             # copy_params_from broadcasts rank 0's values
        with torch.no_grad():
            mine.weight.add_(1.0), mine.bias.add_(1.0)
    with Init(dtype=torch.float32):
        tiled = TiledLinear(23, 29, in_splits=2, out_splits=3, init_linear=mine)
    sharded = [t.weight.ds_tensor.numel() for row in tiled.linears for t in row]
    engine, *_ = zero_from_scratch.initialize(model=tiled, config=CFG)
    xs = torch.randn(world, 3, 23, generator=torch.Generator().manual_seed(5))
    out = engine(xs[rank])
    engine.backward(out.pow(2).mean())
    grads = [safe_get_full_grad(t.weight) for row in tiled.linears for t in row]
    grads += [safe_get_full_grad(row[-1].bias) for row in tiled.linears]
    engine.step()
    weights = [safe_get_full_fp32_param(t.weight) for row in tiled.linears for t in row]
    weights += [safe_get_full_fp32_param(row[-1].bias) for row in tiled.linears]
    return sharded, out.detach(), grads, weights, xs, base.state_dict()


def test_zero3_two_ranks_equal_one_linear(spawn):
    for rank, (sharded, out, grads, weights, xs, sd) in enumerate(spawn(_zero3, 2)):
        base = nn.Linear(23, 29)
        base.load_state_dict(sd)
        tiled = TiledLinear(23, 29, in_splits=2, out_splits=3)   # only for its bounds
        full = [block.numel() for _, block in _blocks(tiled, base.weight)]
        assert sharded == [-(-n // 2) for n in full]           # each tile partitioned on its own
        torch.testing.assert_close(out, base(xs[rank]).detach(), **TOL)
        loss = sum(base(x).pow(2).mean() for x in xs) / len(xs)   # the engine averages over ranks
        loss.backward()
        rows = [slice(tiled.out_parts[o], tiled.out_parts[o + 1]) for o in range(3)]
        ref_grads = [g for _, g in _blocks(tiled, base.weight.grad)] + [base.bias.grad[r] for r in rows]
        assert len(grads) == len(ref_grads) == 9
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, **TOL)
        stepped = [b for _, b in _blocks(tiled, base.weight.detach() - 0.1 * base.weight.grad)]
        stepped += [(base.bias.detach() - 0.1 * base.bias.grad)[r] for r in rows]
        for w, r in zip(weights, stepped):
            torch.testing.assert_close(w, r, **TOL)
