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

Here: one function node per module call over every output tensor that requires grad, found as
DeepSpeed's `apply_to_tensors_only` finds them (inside tuples, lists and dicts, nested; a dict
such as transformers' ModelOutput is updated in place), whose backward calls the stage's
backward hook with the outputs' gradients: the units are gathered when every wrapped output's
gradient is in, before the module's own backward. torch's full backward pre-hook sees only a
tensor or the tensors directly in a tuple; for those the numbers and the traffic are the
textbook's. The frozen units (frozen.py) release after their module's backward through the same
kind of node over the module's inputs (`after_backward`), not torch's full backward hook, which
would wrap the outputs again and drop `ds_param_alias`. Cost: one detach per output (and input) tensor.
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


class _CountedBeforeBackward(_BeforeBackward):
    """DeepSpeed's PreBackwardFunctionForModule (per_module_functions): each call counted in the module's
    applied_pre_backward_ref_cnt, and the backward hook run while the count is positive."""

    @staticmethod
    def forward(ctx, hook, module, *tensors):
        module.__dict__["applied_pre_backward_ref_cnt"] = module.__dict__.get("applied_pre_backward_ref_cnt", 0) + 1
        return _BeforeBackward.forward(ctx, hook, module, *tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.module.__dict__.get("applied_pre_backward_ref_cnt", 0) > 0:
            ctx.hook(ctx.module, grads)
            ctx.module.__dict__["applied_pre_backward_ref_cnt"] -= 1
        return (None, None, *grads)


def per_module_functions(model: torch.nn.Module) -> None:
    """DeepSpeed's per-module hook state (runtime/zero/parameter_offload.py): every module its own
    `pre_bwd_fn` / `post_bwd_fn` classes in its own __dict__ (a wrapper that forwards attribute reads to
    the module it wraps still gets its own) and its own `applied_pre_backward_ref_cnt`. The runner's
    choice: such classes, local to each module, make the model unpicklable, as DeepSpeed's do. The
    count here is one per forward that needs a backward (all of a call's outputs go through one
    function); DeepSpeed's applies its function per output tensor and counts in eval too."""
    for m in model.modules():
        if "pre_bwd_fn" not in m.__dict__:
            m.__dict__["pre_bwd_fn"] = type("PreBackwardFunctionForModule", (_CountedBeforeBackward,), {})
        if "post_bwd_fn" not in m.__dict__:
            m.__dict__["post_bwd_fn"] = type("PostBackwardFunctionModule", (_AfterBackward,), {})
        m.__dict__.setdefault("applied_pre_backward_ref_cnt", 0)


def _wrap(hook, module, tensors: list) -> list:
    outs = list(module.__dict__.get("pre_bwd_fn", _BeforeBackward).apply(hook, module, *tensors))
    for t, o in zip(tensors, outs):
        if hasattr(t, "ds_id"):                        # a ZeRO-3 parameter returned: keep which one
            o.ds_param_alias = t
    return outs


def _alias(p: torch.Tensor) -> torch.Tensor:
    """A frozen ZeRO-3 parameter returned: DeepSpeed's function detaches it too and keeps which one."""
    o = p.detach()
    o.ds_param_alias = p
    return o


def tensors(value):
    """Every tensor anywhere in tuples, lists and dicts, in order (DeepSpeed's apply_to_tensors_only walk)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)


def _collect(value, found: list) -> None:
    """The tensors that require grad, and None for each frozen ZeRO-3 parameter (aliased, not wrapped)."""
    for t in tensors(value):
        if t.requires_grad:
            found.append(t)
        elif hasattr(t, "ds_id"):
            found.append(None)


def _rebuild(value, wrapped):
    """value with each collected tensor replaced, in _collect's order; a dict is changed in place, as
    DeepSpeed's (a ModelOutput stays the same object), a tuple or list rebuilt (namedtuples too)."""
    if isinstance(value, torch.Tensor):
        return next(wrapped) if value.requires_grad else _alias(value) if hasattr(value, "ds_id") else value
    if isinstance(value, (tuple, list)):
        items = [_rebuild(v, wrapped) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        for k in list(value.keys()):
            value[k] = _rebuild(value[k], wrapped)
    return value


def before_backward(hook):
    """A forward hook that routes the module's outputs through `hook` (a backward pre-hook)."""
    def fwd_hook(module, args, output):
        if not torch.is_grad_enabled():
            return None
        found: list = []
        _collect(output, found)
        if not found:
            return None
        grads = [t for t in found if t is not None]
        return _rebuild(output, iter(_wrap(hook, module, grads) if grads else ()))
    return fwd_hook


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward (the module's has run) calls `hook(module, grads)`."""

    @staticmethod
    def forward(ctx, hook, module, *tensors):
        ctx.hook, ctx.module = hook, module
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook(ctx.module, grads)
        return (None, None, *grads)


def after_backward(hook):
    """A forward pre-hook that routes the module's positional input tensors that require grad through
    `hook` (DeepSpeed's PostBackwardFunctionModule on the inputs; torch's full backward hook would
    also re-wrap the outputs and drop their `ds_param_alias`). No such input: the hook never fires."""
    def pre_hook(module, args):
        if not torch.is_grad_enabled():
            return None
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx:
            return None
        outs = module.__dict__.get("post_bwd_fn", _AfterBackward).apply(hook, module, *(args[i] for i in idx))
        new = list(args)
        for i, o in zip(idx, outs):
            new[i] = o
        return tuple(new)
    return pre_hook

