"""`deepspeed.runtime.zero.tiling.TiledLinear`: a Linear as a grid of small Linears; ZeRO-3 gathers a tile at a time.

    layer = TiledLinear(4096, 4096, in_splits=4, out_splits=4, init_linear=base)   # 16 tiles of 1024×1024
    y = layer(x)                           # == base(x): each output block sums its row of tiles

As DeepSpeed 0.19.8's (runtime/zero/tiling.py): the input features are cut into `in_splits`
parts and the output features into `out_splits` by DeepSpeed's partition_uniform (the first
`n % splits` parts one longer); tile [o][i] is `linear_cls(in_i, out_o)` and only the last tile
of each row has a bias. forward cuts x along its last dim, sums a row's tile outputs (the first
cloned, so autograd sees no in-place update of a view) and concatenates the rows. Each tile is
its own module, so under zero.Init / ZeRO-3 each is partitioned and gathered on its own: the
peak full weight is one tile, (in/in_splits)·(out/out_splits) elements, not in·out, at the price
of in_splits·out_splits smaller matmuls and as many gathers. copy_params_from copies a whole
Linear's weight into the tiles, each inside GatheredParameters(modifier_rank=0) as DeepSpeed does
(rank 0's values reach every shard: collective). Cost of forward: the Linear's flops, in tiles.
"""
from __future__ import annotations

import torch

from zero_from_scratch.as_deepspeed.partitioned_tensor import partition_uniform
from zero_from_scratch.engine.zero_gathered import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]


def split_tensor_along_last_dim(tensor, partitions, contiguous_split_chunks=False):
    """torch.split along the last dim by sizes `partitions` (views unless contiguous_split_chunks)."""
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


class TiledLinear(torch.nn.Module):
    """A drop-in for torch.nn.Linear built of in_splits × out_splits tiles (DeepSpeed's arguments)."""

    def __init__(self, in_features, out_features, bias=True, in_splits=1, out_splits=1,
                 input_is_already_split=False, combine_out_splits=True, linear_cls=torch.nn.Linear,
                 init_linear=None, **kwargs):
        super().__init__()
        if in_splits < 1 or in_splits > in_features:
            raise RuntimeError('in splits must be in range [1, in_features].')
        if out_splits < 1 or out_splits > out_features:
            raise RuntimeError('out splits must be in range [1, out_features].')
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        # CSR-style bounds: part p is [parts[p], parts[p + 1])
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            row = torch.nn.ModuleList()
            for i in range(in_splits):          # one bias per output block: the row's last tile
                in_dim, out_dim = self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o]
                row.append(linear_cls(in_dim, out_dim, bias=bias if i == in_splits - 1 else False, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.in_splits > 1 and not self.input_is_already_split:
            parts = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [parts[p + 1] - parts[p] for p in range(self.in_splits)])
        elif self.in_splits > 1:
            inputs = input_
            assert len(inputs) == self.in_splits, \
                f"Col splits {self.in_splits} does not match input splits {len(inputs)}"
        else:
            inputs = [input_]
        outputs = [None] * self.out_splits
        for o in range(self.out_splits):
            for i in range(self.in_splits):
                outputs[o] = self._reduce_local_output(in_id=i, out_id=o, current_out=outputs[o],
                                                       new_out=self.linears[o][i](inputs[i]))
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input, split_sizes):
        """The input cut along its last dim (subclasses override for other input types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        """Sum a tile's output into its row's; the first is cloned (a view updated in place upsets autograd)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs):
        assert len(outputs) == self.out_splits
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other):
        """Copy a Linear's weight (and bias) into the tiles; under ZeRO-3 a collective: rank 0's values win."""
        assert hasattr(other, 'weight')
        assert other.weight.size() == (self.out_features, self.in_features)
        if self.use_bias:
            assert getattr(other, 'bias', None) is not None and other.bias.size() == (self.out_features, )
        else:
            assert other.bias is None
        for row in range(self.out_splits):
            rstart, rstop = self.out_parts[row], self.out_parts[row + 1]
            for col in range(self.in_splits):
                local = self.linears[row][col]
                with GatheredParameters(local.weight, modifier_rank=0):
                    local.weight.copy_(other.weight[rstart:rstop, self.in_parts[col]:self.in_parts[col + 1]])
            if local.bias is not None:          # the row's last tile holds the bias
                with GatheredParameters(local.bias, modifier_rank=0):
                    local.bias.data.copy_(other.bias[rstart:rstop].data)


class TiledLinearReturnBias(TiledLinear):
    """Tiles whose linear_cls returns (output, bias), as Megatron-LM's: outputs summed, biases concatenated."""

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        assert isinstance(new_out, tuple) and len(new_out) == 2
        tensor, bias = new_out
        assert tensor is not None
        tensor = super()._reduce_local_output(in_id=in_id, out_id=out_id, current_out=old_tensor, new_out=tensor)
        return tensor, old_bias if bias is None else bias

    def _combine_output_splits(self, outputs):
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None
