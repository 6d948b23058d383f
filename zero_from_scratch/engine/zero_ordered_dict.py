"""DeepSpeed's ZeROOrderedDict: the `_parameters` container its ZeRO-3 puts on every module, which
marks the forward so that a parameter read there is discovered (runtime/zero/parameter_offload.py).

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json   (stage 3)

Under the runner (external.py's auto_register) every module's `_parameters` is one at initialize,
and every forward converts modules attached since (ensure_zero_ordered_dict, as DeepSpeed's
_forward_prologue does) and sets `_in_forward` for its duration. The discovery itself is
external.py's forward guard: a partitioned parameter reaching a torch op is registered to the
module in forward and gathered, so reading the dict returns the Parameter as it is (DeepSpeed's
__getitem__ gathers there instead: the same parameter, gathered one op earlier).
Cost: one walk over the modules per forward.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict


class ZeROOrderedDict(OrderedDict):
    def __init__(self, parent_module, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self._in_forward = False

    def __reduce__(self):
        r0, _, *r2 = super().__reduce__()
        return (r0, (self._parent_module, )) + tuple(r2)


def ensure_zero_ordered_dict(module) -> None:
    """DeepSpeed's: wrap module._parameters once (keeping the first container as _original_parameters);
    a no-op when already wrapped, missing, or not a dict."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    new = ZeROOrderedDict(parent_module=module)
    for key, param in params.items():
        new[key] = param
    module._parameters = new


@contextlib.contextmanager
def in_forward(root):
    """DeepSpeed's _forward_prologue / _forward_epilogue at ZeRO-3."""
    mods = list(root.modules())
    for m in mods:
        ensure_zero_ordered_dict(m)
        m._parameters._in_forward = True
    try:
        yield
    finally:
        for m in mods:
            if isinstance(m._parameters, ZeROOrderedDict):
                m._parameters._in_forward = False
