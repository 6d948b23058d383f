"""ZeRO-3's backward gather riding on a module's outputs, as DeepSpeed places it.

    python -m pytest -q tests/test_zero3_outputs.py

The textbook Stage3 gathers a module's units for its backward in torch's
`register_full_backward_pre_hook`. torch serves that hook by passing the module's inputs and
outputs through its own function after every forward hook has run, so a Parameter the module
returns comes back as torch's plain alias: no `ds_status`, nothing to say which parameter it is.
DeepSpeed (runtime/zero/parameter_offload.py, `_pre_backward_module_hook`) instead passes the
outputs through its own function in a forward hook, and an output that was a ZeRO-3 parameter
keeps the parameter as `ds_param_alias` (runtime/zero/utils.py, `apply_to_tensors_only`), so the
caller's module can register it as an external parameter (external.py) and read its status.

Here: one function node per module call over the same tensors torch wraps (a tensor, or the
tensors directly in a tuple or list, that require grad), whose backward calls the stage's
backward hook with the outputs' gradients: the same units gathered at the same moment (when
every wrapped output's gradient is in), so the numbers and the traffic are the textbook's.
The inputs are left alone (torch wraps them too). Cost: one detach per output tensor.
"""
from __future__ import annotations

import torch


class _BeforeBackward(torch.autograd.Function):
    """Identity on the outputs; its backward first runs `hook(module, grad_outputs)`."""

    @staticmethod
    def forward(ctx, hook, module, *tensors):
        ctx.hook, ctx.module = hook, module
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)      # DeepSpeed's PreBackwardFunctionForModule: detach

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook(ctx.module, grads)
        return (None, None, *grads)


def _wrap(hook, module, tensors: list) -> list:
    outs = list(_BeforeBackward.apply(hook, module, *tensors))
    for t, o in zip(tensors, outs):
        if hasattr(t, "ds_id"):                        # a ZeRO-3 parameter returned: keep which one
            o.ds_param_alias = t
    return outs


def before_backward(hook):
    """A forward hook that routes the module's outputs through `hook` (a backward pre-hook)."""
    def fwd_hook(module, args, output):
        if not torch.is_grad_enabled():
            return None
        if isinstance(output, torch.Tensor):
            return _wrap(hook, module, [output])[0] if output.requires_grad else None
        if not isinstance(output, (tuple, list)):
            return None                                # a dict or object: torch does not wrap it either
        idx = [i for i, o in enumerate(output) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not idx:
            return None
        items = list(output)
        for i, o in zip(idx, _wrap(hook, module, [output[i] for i in idx])):
            items[i] = o
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    return fwd_hook
