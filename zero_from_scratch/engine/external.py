"""ZeRO-3 parameters used outside their module's forward: registered, or a clear error.

    python -m pytest -q tests/test_recipes_tied.py

Stage 3 gathers a parameter in the forward pre-hook of every module that *holds* it
(`module.parameters(recurse=False)`), which covers tied weights: GPT-2's lm_head and wte hold the
same Parameter, T5's `shared` sits in the encoder, the decoder and the head, so each gathers it
where it is used and its gradient, accumulated by autograd over every use, is reduced once.

A parameter read by a module that does not hold it (`F.linear(x, self.other.weight)`) is empty
there (torch.Size([0])). DeepSpeed's answer is `deepspeed.zero.register_external_parameter(module,
param)`; ours takes the same call (or honours the `_external_params` dict DeepSpeed's version
writes): the unit is gathered before `module`'s forward and pinned until it returns (so the
owner's own post-forward release cannot free it mid-use), and gathered again in backward when
autograd unpacks the weight it saved (a module's backward hook would not fire for a root module
whose output is a ModelOutput, not a tensor). Cost: one extra all-gather of the unit per use, (N-1)/N·b·numel.

Unregistered use is caught by a TorchFunctionMode active during the engine's forward: any torch
op that receives an empty engine parameter raises ZeroExternalParameterError naming the parameter,
its owner and the fix, on every rank (every rank runs the same forward), instead of a shape error
deep inside the model. With `auto_register` (the runner's default: DeepSpeed's ZeROOrderedDict,
runtime/zero/parameter_offload.py, registers a parameter read in forward to the innermost module
in forward) the parameter is registered to the innermost module whose `forward` frame is on the
stack, gathered, and the op runs; rank 0 says so once per parameter. Cost: one Python check per
torch op of the forward (a few µs each); a stack walk on the first unregistered use.
Also under the runner, DeepSpeed's dangling parameters: a parameter a module *returns* (or its
`ds_param_alias`, z3_outputs.py) is registered to the innermost module still in forward before the
module's release, and moves outward as each module returns it. Cost: one output check per module call.
"""
from __future__ import annotations

import contextlib
import sys
import warnings

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from zero_from_scratch.engine.zero_ordered_dict import in_forward


_METADATA = {"__get__", "__set__", "dim", "size", "numel", "element_size", "is_floating_point", "data_ptr",
             "untyped_storage", "requires_grad_", "is_complex", "get_device", "__len__", "stride"}


class ZeroExternalParameterError(RuntimeError):
    """A ZeRO-3 parameter was used by a module that does not hold it, without registration."""


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Like deepspeed.zero.register_external_parameter: `module`'s forward uses `parameter`.
    Before initialize(): recorded and picked up by the engine; after: hooked at once."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter needs an nn.Parameter, got {type(parameter).__name__}")
    if not hasattr(module, "_external_params"):
        module._external_params = {}
    module._external_params[id(parameter)] = parameter
    ext = module.__dict__.get("_zero_external")
    if ext is not None:
        ext.register(module, parameter)


class ExternalParams:
    """Stage 3 only: hooks for registered external parameters, and the forward guard."""

    def __init__(self, engine):
        self.e = engine
        self.done: set = set()
        self.calls: dict = {}
        self.pins: dict[int, int] = {}
        self.auto_register = False
        if engine.stage_id != 3:
            return
        st = engine.stage
        units = list(engine.layout.units) + list(getattr(engine.frozen, "units", []))
        self.unit_of = {id(st.params[s.name]): u for u in units for s in u.slots}
        self.owner = {}
        for mname, m in engine.module.named_modules():
            for p in m.parameters(recurse=False):
                self.owner.setdefault(id(p), mname or "<root>")
        self.name_of = {id(p): n for n, p in st.params.items()}
        self.external_units: dict = {}
        st.pinned = self.pins                # an external user is mid-forward: keep it
        st.saved.regather = self.external_units   # a registered unit's saved weight, needed in backward
        for mname, m in engine.module.named_modules():
            m.__dict__["_zero_external"] = self
            m.__dict__.setdefault("_external_params", {})     # as DeepSpeed's stage 3 gives every module
            for p in list(getattr(m, "_external_params", {}).values()):
                self.register(m, p)
            st.hooks.append(m.register_forward_hook(self._returned, prepend=True))   # before the release

    def register(self, module: nn.Module, p: nn.Parameter) -> None:
        if self.e.stage_id != 3 or (id(module), id(p)) in self.done:
            return
        u = self.unit_of.get(id(p))
        if u is None:
            raise ValueError(f"rank {self.e.comm.rank}: register_external_parameter: a tensor of shape "
                             f"{tuple(p.shape)} is not a parameter of the engine's model")
        self.done.add((id(module), id(p)))
        self.external_units[u.index] = u
        st, label = self.e.stage, f"{type(module).__name__} (external {self.name_of[id(p)]})"

        calls = self.calls.setdefault((id(module), id(p)), [])   # per call: did it pin u (see register_now)

        def pre(mod, args):
            calls.append(id(p) in mod.__dict__.get("_external_params", {}))
            if calls[-1]:
                self.pin(u, label)

        def post(mod, args, out):
            if calls and calls.pop():
                self.pins[u.index] -= 1
                st._release(u, "external")
        # the stage's hooks: engine.destroy (a second engine on the model) and unwrap take them off too
        st.hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def register_now(self, module: nn.Module, p: nn.Parameter, label: str) -> None:
        """Register p to `module` in the middle of its forward (its pre hook has run): gathered
        and pinned now, released by its post hook."""
        register_external_parameter(module, p)
        calls = self.calls[(id(module), id(p))]
        if calls:
            calls[-1] = True      # this call's own entry (its pre hook ran, unregistered): its post releases
        else:
            calls.append(True)    # the hooks are new: this call had no pre hook
        self.pin(self.unit_of[id(p)], label)

    def pin(self, u, label: str) -> None:
        self.e.stage._gather(u, "forward", f"forward of {label}")
        self.pins[u.index] = self.pins.get(u.index, 0) + 1

    def _returned(self, module, args, output) -> None:
        """Under the runner, DeepSpeed's dangling parameters (parameter_offload.py,
        `_post_forward_module_hook`): a ZeRO-3 parameter a module returns (or its `ds_param_alias`,
        z3_outputs.py) becomes an external parameter of the innermost module still in forward,
        unless one of those holds it already, and leaves `module`'s own registration."""
        if not self.auto_register:
            return
        items = output if isinstance(output, (tuple, list)) else [output] if isinstance(output, torch.Tensor) else \
            list(output.values()) if isinstance(output, dict) else list(getattr(output, "__dict__", {}).values())
        for item in items:
            p = getattr(item, "ds_param_alias", item)
            if not isinstance(p, nn.Parameter) or id(p) not in self.unit_of:
                continue
            stack = _in_forward(self.e.module)
            if not stack or any(id(p) in m.__dict__.get("_external_params", {}) for m in stack):
                continue
            # DeepSpeed's coordinator then releases it at no module's hook, only at the step's reset
            p.is_external_param = True
            self.e.stage.dangling.add(self.unit_of[id(p)].index)
            self.register_now(stack[0], p, f"{type(stack[0]).__name__} (returned {self.name_of[id(p)]})")
            module.__dict__.get("_external_params", {}).pop(id(p), None)

    def guard(self):
        """The forward's TorchFunctionMode (stage 3), or a no-op context."""
        if self.e.stage_id != 3:
            return contextlib.nullcontext()
        if self.auto_register:     # the runner: DeepSpeed's ZeROOrderedDict on every module (zero_ordered_dict.py)
            return _both(in_forward(self.e.module), _Guard(self))
        return _Guard(self)


def discover(*tensors) -> None:
    """The guard's check on `tensors` now, for a custom autograd Function about to receive them: it
    records its inputs' shapes before its forward runs an op the guard sees (DeepSpeed's ZeROOrderedDict
    gathers at the read, before any call)."""
    for mode in torch.overrides._get_current_function_mode_stack():
        if isinstance(mode, _Guard):
            for t in tensors:
                mode._check(t, discover)


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


class _Guard(TorchFunctionMode):
    def __init__(self, ext: ExternalParams):
        super().__init__()
        self.ext = ext

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _METADATA:
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)):
                    for b in a:
                        self._check(b, func)
                else:
                    self._check(a, func)
        return func(*args, **kwargs)

    def _check(self, a, func) -> None:
        if isinstance(a, nn.Parameter) and id(a) in self.ext.unit_of and a.numel() == 0:
            x = self.ext
            n = x.name_of.get(id(a), "?")
            module = _innermost_in_forward(x.e.module) if x.auto_register else None
            if module is not None:
                x.register_now(module, a, f"{type(module).__name__} (external {n})")
                if x.e.comm.rank == 0:
                    warnings.warn(f"ZeRO-3 parameter {n!r} used outside its module's forward: registered as an "
                                  f"external parameter of {type(module).__name__}, as DeepSpeed does", stacklevel=4)
                return
            raise ZeroExternalParameterError(
                f"rank {x.e.comm.rank}: ZeRO-3 parameter {n!r} (held by module {x.owner.get(id(a), '?')!r}) was "
                f"used by {getattr(func, '__name__', func)} outside the forward of any module that holds it, so it "
                "is empty here (torch.Size([0])). Register the module that uses it: "
                "zero_from_scratch.register_external_parameter(module, param) (or deepspeed.zero's) before or "
                "after initialize()")


def _in_forward(root: nn.Module) -> list:
    """The modules of `root`'s tree whose `forward` frame is on the stack, innermost first
    (DeepSpeed's FWD_MODULE_STACK, read from the frames)."""
    mods, out = {id(m) for m in root.modules()}, []
    f = sys._getframe(1)
    while f is not None:
        me = f.f_locals.get("self") if f.f_code.co_name == "forward" else None
        if me is not None and id(me) in mods and (not out or out[-1] is not me):
            out.append(me)
        f = f.f_back
    return out


def _innermost_in_forward(root: nn.Module) -> nn.Module | None:
    """The module of the innermost `forward` frame on the stack that belongs to `root`'s tree."""
    stack = _in_forward(root)
    return stack[0] if stack else None
