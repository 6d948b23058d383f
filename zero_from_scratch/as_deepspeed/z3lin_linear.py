"""DeepSpeed's ZeRO-3 Linear under the runner: its own autograd function in place of torch.nn.functional.linear.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json     (ZeRO-3 or zero.Init)
    python -m pytest -q tests/test_zero3_linear.py

DeepSpeed 0.19.8 (runtime/zero/partition_parameters.py, `_enable_mem_efficient_linear`) sets
`torch.nn.functional.linear = zero3_linear_wrap` when a zero.Init context is entered (the outermost
one), when `zero.Init(module=...)` partitions a built model, and so when initialize at stage 3 gets a
model not built under Init (parameter_offload.py, `_convert_to_zero_parameters`), unless
`zero_optimization.memory_efficient_linear` is false. The torch function is kept once, in
`InsertPostInitMethodToModuleSubClasses.linear_bk`, and F.linear is put back only where it still is
that backup (a wrapper put over it stays); nothing restores it afterwards ("this will persist").
The runner does the same (`enable`), so the attribute a script or a test reads is DeepSpeed's.

What the function saves for backward: (input, weight, bias), the weight and bias as the Parameter
objects themselves (runtime/zero/linear.py, `setup_context`), not torch's `weight.t()` view of the
gathered buffer. The parameter's data is released after the module's forward (its ZeRO-3 unit is
dropped: torch.Size([0])) and gathered again before its backward, so what autograd keeps from forward
to backward is the input alone, as with torch's F.linear under ringzero's saved-by-reference hooks
(engine/saved.py); those hooks step aside inside this function so it saves what DeepSpeed's saves
(a script's own saved-tensor hooks then see the Parameter, as under DeepSpeed). A weight passed as a
slice or other view of a gathered Parameter is saved as that tensor, so it keeps its unit's buffer
until backward, as DeepSpeed's function does. A weight read outside the module holding it is gathered
before the function records its inputs' shapes (engine/external.py, discover); in backward a weight
not gathered (`ds_status` NOT_AVAILABLE) is gathered for the products and released after (DeepSpeed:
`weight.all_gather()` … `weight.partition()`; here GatheredParameters, which keeps the unit until its
gradient is reduced); a recompute in backward keeps its units gathered until their backward is done
(engine/saved.py, recomputed), as torch's checkpoint compares the Parameter's shape then. The products are
DeepSpeed's: addmm(bias, x, Wᵀ) for a 2-D input with a bias, else x·Wᵀ (+ b); backward g·W, gᵀ·x,
Σg. Cost: none in bytes or messages beyond torch's F.linear; the Parameter references only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zero_from_scratch.as_deepspeed.accelerator import get_accelerator
from zero_from_scratch.as_deepspeed.finder import NotServedError, message
from zero_from_scratch.engine import external, saved as saved_mod
from zero_from_scratch.engine.zero_init import GatheredParameters
from zero_from_scratch.engine.zero_partition import ZeroParamStatus, is_zero_param


def _autocast_state(device_type: str) -> tuple:
    return torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """DeepSpeed's runtime/zero/linear.py function: the Parameter saved, gathered in backward if it is not."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias=None):
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())       # fused op, as DeepSpeed's
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias
        return output

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx._dtype, ctx._fwd_used_autocast = _autocast_state(get_accelerator().device_name())
        input, weight, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        # backward runs under forward's autocast state (DeepSpeed's custom_bwd semantics)
        with torch.autocast(device_type=get_accelerator().device_name(), enabled=ctx._fwd_used_autocast,
                            dtype=ctx._dtype):
            input, weight, bias = ctx.saved_tensors
            gone = is_zero_param(weight) and getattr(weight, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE
            if gone:
                with GatheredParameters([weight]):
                    return _grads(ctx, grad_output, input, weight, bias)
            return _grads(ctx, grad_output, input, weight, bias)


def _grads(ctx, grad_output, input, weight, bias):
    grad_input = grad_weight = grad_bias = None
    dim = grad_output.dim()
    if ctx.needs_input_grad[0]:
        grad_input = grad_output.matmul(weight)
    if ctx.needs_input_grad[1]:
        if dim > 2:
            grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
        elif dim == 1:
            grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
        else:
            grad_weight = grad_output.t().matmul(input)
    if bias is not None and ctx.needs_input_grad[2]:
        grad_bias = grad_output.sum(list(range(dim - 1))) if dim > 2 else grad_output if dim == 1 else grad_output.sum(0)
    return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):
    """DeepSpeed's F.linear under ZeRO-3; ringzero's saved-by-reference hooks step aside (see the docstring)."""
    external.discover(weight, bias)     # a weight read outside its module: gathered before apply records its shape
    with saved_mod.plain_saves():
        return LinearFunctionForZeroStage3.apply(input, weight, bias)


class InsertPostInitMethodToModuleSubClasses:
    """DeepSpeed's base of zero.Init; here only the class-wide `linear_bk` (torch's F.linear, once swapped).
    Building or subclassing it is refused: DeepSpeed's patches every module class's __init__."""
    _WHAT = ("patch every torch.nn.Module subclass's __init__ to run a hook after it",
             "deepspeed.zero.Init (zero_init.py)")

    def __init__(self, *args, **kwargs):
        raise NotServedError(message("deepspeed.runtime.zero.partition_parameters."
                                     "InsertPostInitMethodToModuleSubClasses()", *self._WHAT))

    def __init_subclass__(cls, **kwargs):
        raise NotServedError(message("a subclass of deepspeed.runtime.zero.partition_parameters."
                                     "InsertPostInitMethodToModuleSubClasses", *cls._WHAT))


def enable() -> None:
    """DeepSpeed's `_enable_mem_efficient_linear`: back up torch's F.linear once, swap in ours where it still is."""
    if not hasattr(InsertPostInitMethodToModuleSubClasses, "linear_bk"):
        InsertPostInitMethodToModuleSubClasses.linear_bk = F.linear
    if F.linear is InsertPostInitMethodToModuleSubClasses.linear_bk:
        F.linear = zero3_linear_wrap


def wanted(config, default: bool = True) -> bool:
    """zero_optimization.memory_efficient_linear of a config dict (DeepSpeed's default: true), else `default`."""
    if not isinstance(config, dict):
        return default
    return bool((config.get("zero_optimization") or {}).get("memory_efficient_linear", True))

