"""`deepspeed.zero.Init` under the runner: ringzero's Init (engine/zero_init.py), started as DeepSpeed starts it.

    with deepspeed.zero.Init():            (under python -m zero_from_scratch.as_deepspeed SCRIPT)
        model = build()

DeepSpeed's Init starts torch.distributed itself when nobody has (runtime/zero/partition_parameters.py,
Init.__init__: `if not dist.is_initialized(): init_distributed()`), so a script may enter Init
before deepspeed.initialize; here the runner's init_distributed does the same (launcher variables,
or rank 0 of 1), then ringzero's Init partitions. As DeepSpeed's, the outermost context entered and
`Init(module=...)` put DeepSpeed's ZeRO-3 Linear in place of torch.nn.functional.linear unless
`zero_optimization.memory_efficient_linear` (or mem_efficient_linear=) is false (z3lin_linear.py);
with `weight_quantization.quantized_initialization` each Linear / Embedding weight built inside is
quantised before it is partitioned, and F.linear / F.embedding dequantise it (quantized_init.py).
Cost: one check (and the quantisation, when asked for).
"""
from __future__ import annotations

import inspect

import torch.distributed as dist

from zero_from_scratch.as_deepspeed import finder, served, z3lin_linear, quantized_init
from zero_from_scratch.as_deepspeed.top import init_distributed
from zero_from_scratch.engine import zero_init, group_check
from zero_from_scratch.engine.zero_partition import STATE, is_zero_param


_SIGNATURE = inspect.signature(zero_init.Init.__init__)


class _Refusing(type):
    """DeepSpeed's Init internals ringzero refuses (served.REFUSED) raise the one-line error when read."""

    def __getattr__(cls, attr):
        name = f"deepspeed.runtime.zero.partition_parameters.Init.{attr}"
        if name in served.REFUSED:
            raise finder.NotServedAttributeError(finder.message(name, *served.REFUSED[name]))
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {attr!r}")


class Init(zero_init.Init, metaclass=_Refusing):
    refuse_group = staticmethod(group_check.refuse_as_deepspeed)    # DeepSpeed's words (deepspeed.init_distributed)

    def __init__(self, *args, **kwargs):
        a = _SIGNATURE.bind(self, *args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        cfg = zero_init._load(a["config_dict_or_path"] if a["config_dict_or_path"] is not None else a["config"])
        quant = ((cfg or {}).get("weight_quantization") or {}).get("quantized_initialization") or None
        self.quantized_initialization = quantized_init._check(quant) if quant else None
        if not dist.is_initialized():
            init_distributed()
            assert dist.is_initialized(), "Parameters cannot be scattered without initializing deepspeed.comm"
        super().__init__(*args, **kwargs)
        self.mem_efficient_linear = z3lin_linear.wanted(cfg, a["mem_efficient_linear"])
        if a["module"] is not None and self.enabled and self.mem_efficient_linear:
            z3lin_linear.enable()

    def __enter__(self):
        if self.enabled and STATE.depth == 0 and self.mem_efficient_linear:   # DeepSpeed's patch_init_and_builtins
            z3lin_linear.enable()
            if self.quantized_initialization:
                quantized_init.patch_functionals()
        return super().__enter__()

    def _post_init(self, module):
        """Built inside this context: a Linear / Embedding weight is quantised first (DeepSpeed's _post_init_method)."""
        w = module._parameters.get("weight") if type(module) in quantized_init.WEIGHT_QUANTIZATION_LAYERS else None
        if (self.quantized_initialization and STATE.top is self and w is not None and not is_zero_param(w)
                and not w.is_meta):
            if self.dtype is not None and w.is_floating_point():   # DeepSpeed builds it in Init's dtype already
                w.data = w.data.to(self.dtype)
            quantized_init._quantize_param(w, self.quantized_initialization)
        super()._post_init(module)
