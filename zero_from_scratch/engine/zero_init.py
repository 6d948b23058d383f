"""deepspeed.zero.Init and GatheredParameters: build a model already partitioned, read and edit it.

    with Init(config_dict_or_path=cfg):            # torch.distributed initialised, every rank
        model = MyModel()                          # no rank ever holds the whole model
    with GatheredParameters(model.fc.weight, modifier_rank=0):
        if rank == 0: model.fc.weight.zero_()      # rank 0's edit reaches every shard on exit
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)   # ZeRO-3 adopts the shards

Init wraps the __init__ of every nn.Module class (existing ones, and ones defined inside), as
DeepSpeed does; when a module's outermost __init__ returns, its direct parameters are partitioned
(zero_partition.py: rank 0's value scattered, (N-1)/N·b·numel). Each module is built whole on
every rank with the untouched RNG stream and partitioned at once, so values equal the model
built without Init under the same seed; peak ≈ the shards so far + the largest module's own
parameters. A parent that later touches a child's partitioned parameter (a custom init,
transformers' post_init → _init_weights, `w.data[pad].zero_()`) is served by a TorchFunctionMode:
the first torch op that reads such a parameter gathers it ((N-1)/N·b·numel); it stays full until
an op touches a parameter of another module, a module's __init__ returns or Init exits, and is
then partitioned again from rank 0's value (DeepSpeed wraps only Module.apply and raises an
IndexError in transformers' _init_weights instead). A view kept across that point writes to the
dropped full copy: finish editing a module before touching the next.

Arguments as DeepSpeed 0.19.8's: config_dict_or_path (or the deprecated config) gives the dtype
(bf16/fp16 "enabled"); dtype overrides it; with neither, parameters keep the constructor's dtype
(DeepSpeed picks fp16/bf16 by accelerator: warned). dtype applies to the parameter shards; buffers
keep theirs until initialize casts the model. remote_device None/"cpu": shards stay on the
parameters' device; "nvme", or the config's offload_param.device "nvme" (which wins, as in DeepSpeed):
each shard is written to a file under offload_param.nvme_path as it is made (init_swap.py), so a
rank holds one module, never Ψ/N; without a config naming nvme_path it is refused (DeepSpeed asserts).
module=: partition an already built model. mpu: DeepSpeed hands it to its config object only (batch
arithmetic); accepted, unused. mem_efficient_linear: the engine saves Linear weights by reference (saved.py).
data_parallel_group: the torch.distributed group to partition over (default: the world; refused, enabled
or not, as DeepSpeed refuses it, when that world is one rank, or torch.distributed is not started, but the
launcher's WORLD_SIZE > 1: group_check.py). config reading: zero_init_config.py.
"""
from __future__ import annotations

import warnings, weakref

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from zero_from_scratch.engine import allocator, zero_partition as zp
from zero_from_scratch.engine.external import register_external_parameter
from zero_from_scratch.engine.zero_gathered import GatheredParameters
from zero_from_scratch.engine.zero_partition import STATE, ZeroParamStatus, is_zero_param
from zero_from_scratch.engine.zero_init_config import _dtype_from, _load, _swap_from
from zero_from_scratch.engine.group_check import refuse_single_rank_group

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "ZeroParamStatus"]

# deepspeed.runtime.zero.partition_parameters' names that transformers' prevent_arange_dtype_change
# swaps around Init: this Init wraps no tensor constructor, so the factory returns fn unchanged.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    return fn

# metadata reads that must not gather a partitioned parameter
_SAFE = {"dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "_grad_fn", "layout", "names",
         "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested", "requires_grad_", "is_floating_point",
         "is_complex", "element_size", "get_device", "_base", "__class__", "__dict__", "_version"}


class Init:
    """Context: modules constructed inside have their parameters partitioned as they are built."""
    refuse_group = staticmethod(refuse_single_rank_group)     # the runner's Init words it as DeepSpeed does

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None,
                 param_swapper=None, tensor_overrides=None):
        refused = {"zero_param_parallel_group": zero_param_parallel_group, "param_swapper": param_swapper,
                   "zero_quantized_weights": zero_quantized_weights or None, "tensor_overrides": tensor_overrides,
                   "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights or None}
        for k, v in refused.items():
            if v is not None:
                raise NotImplementedError(f"Init({k}=...) is not supported: DeepSpeed uses it for hpZ/ZeRO++ groups, "
                                          "quantised or swapped partitions or tensor-constructor overrides; here "
                                          "Init partitions over data_parallel_group and the engine's config applies "
                                          "hpZ / quantisation / offload at initialize()")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"Init(remote_device={remote_device!r}): DeepSpeed takes None, 'none', 'cpu' or 'nvme'")
        if config is not None:
            warnings.warn("zero.Init: the `config` argument is deprecated; use `config_dict_or_path` (as DeepSpeed "
                          "says)", stacklevel=2)
            config_dict_or_path = config
        cfg = _load(config_dict_or_path)
        self.swap = _swap_from(cfg, remote_device, enabled)   # shards to a file as they are made, or None
        if data_parallel_group is not None and sequence_data_parallel_group is not None:
            raise ValueError("Init: both 'data_parallel_group' and 'sequence_data_parallel_group' were specified")
        self.enabled = enabled
        self.group = data_parallel_group if data_parallel_group is not None else sequence_data_parallel_group
        self.refuse_group(self.group)           # enabled or not, as DeepSpeed's Init
        self.dtype = dtype if dtype is not None else _dtype_from(cfg)
        if self.dtype is None and enabled:
            warnings.warn("zero.Init without dtype or config: parameters keep the constructor's dtype (DeepSpeed "
                          "would cast them to fp16/bf16, whichever the accelerator supports)", stacklevel=2)
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        if pin_memory and not self.pin:
            warnings.warn("zero.Init(pin_memory=True): no accelerator, shards stay in pageable memory", stacklevel=2)
        self.classes: dict = {}                 # class -> its original __init__
        self.entered: set[int] = set()          # modules whose outermost __init__ is running
        self.built: list = []                   # weakrefs of the modules constructed inside
        self.full: list = []                    # parameters gathered by the mode, to partition again
        self.mode = None
        if module is not None and enabled:
            for m in module.modules():
                self._post_init(m)

    # ------------------------------------------------------------------ the context
    def __enter__(self):
        if not self.enabled:
            return self
        if STATE.depth == 0:
            allocator.map_large_blocks()      # each module's weights, freed once partitioned, leave at once
            STATE.top = self
            self._patch()
            self.mode = _Touch(self)
            self.mode.__enter__()
        STATE.depth += 1
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        STATE.depth -= 1
        if STATE.depth == 0:
            top, STATE.top = STATE.top, None
            try:
                top.mode.__exit__(None, None, None)
            finally:
                top._unpatch()
            if exc[0] is None:
                top.flush()
                for ref in top.built:            # a parameter a parent assigned after its owner was built
                    m = ref()
                    if m is not None:
                        top._post_init(m)
        return False

    def _patch(self) -> None:
        def wrap(cls):
            if "__init__" in cls.__dict__ and cls not in self.classes:
                self.classes[cls] = cls.__dict__["__init__"]
                cls.__init__ = _wrapped(cls.__dict__["__init__"])

        stack = [nn.Module]
        while stack:
            c = stack.pop()
            wrap(c)
            stack += c.__subclasses__()
        self.had_init_subclass = "__init_subclass__" in nn.Module.__dict__
        self.old_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            wrap(cls)
        nn.Module.__init_subclass__ = classmethod(init_subclass)

    def _unpatch(self) -> None:
        for cls, init in self.classes.items():
            cls.__init__ = init
        self.classes.clear()
        if self.had_init_subclass:
            nn.Module.__init_subclass__ = self.old_init_subclass
        else:
            del nn.Module.__init_subclass__

    # ------------------------------------------------------------------ partitioning
    def _post_init(self, module: nn.Module) -> None:
        """After a module's outermost __init__: partition its direct parameters not yet partitioned."""
        STATE.busy += 1
        try:
            self.flush()
            for p in module.parameters(recurse=False):
                if not is_zero_param(p) and not p.is_meta:   # meta (skip_init): nothing to scatter yet
                    zp.partition(p, self.group, 0, self.dtype, self.swap)
                    p._zero_owner = id(module)
                    if self.pin:
                        p.ds_tensor = p.ds_tensor.pin_memory()
        finally:
            STATE.busy -= 1

    def touch(self, params: list) -> None:
        """Ops of the mode read these partitioned parameters: gather them (others' modules flushed first)."""
        owners = {getattr(p, "_zero_owner", None) for p in params}
        if any(getattr(q, "_zero_owner", None) not in owners for q in self.full):
            self.flush()
        for p in sorted(params, key=lambda q: q.ds_id):
            zp.fetch(p)
            self.full.append(p)

    def flush(self) -> None:
        """Partition again every parameter the mode gathered (rank 0's value, shapes as they are now)."""
        full, self.full = self.full, []
        for p in sorted(full, key=lambda q: q.ds_id):
            if p.ds_status is ZeroParamStatus.AVAILABLE:
                zp.partition(p, p.ds_process_group, 0, self.dtype)


def _wrapped(init):
    def __init__(module, *args, **kwargs):
        top = STATE.top
        if getattr(type(module), "_zero_init_paused", False):   # initialize() inside Init: not construction
            STATE.busy += 1
            try:
                return init(module, *args, **kwargs)
            finally:
                STATE.busy -= 1
        outer = top is not None and id(module) not in top.entered
        if outer:
            top.entered.add(id(module))
        try:
            init(module, *args, **kwargs)
        finally:
            if outer:
                top.entered.discard(id(module))
        if outer:
            top.built.append(weakref.ref(module))
            top._post_init(module)
    __init__.__wrapped__ = init
    __init__.__name__, __init__.__qualname__, __init__.__doc__ = init.__name__, init.__qualname__, init.__doc__
    return __init__


def _name(func) -> str:
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") in ("__get__", "__set__") and owner is not None:
        return getattr(owner, "__name__", "")
    return getattr(func, "__name__", "")


def _partitioned(a) -> bool:
    return isinstance(a, nn.Parameter) and zp.held_by_init(a) and a.ds_status is ZeroParamStatus.NOT_AVAILABLE


class _Touch(TorchFunctionMode):
    """Inside Init: a torch op on a partitioned parameter first gathers it (Init.touch)."""

    def __init__(self, ctx: Init):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not STATE.busy and _name(func) not in _SAFE:
            hit = [a for a in (*args, *kwargs.values()) if _partitioned(a)]
            hit += [b for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) for b in a if _partitioned(b)]
            if hit:
                STATE.busy += 1
                try:
                    self.ctx.touch(list({id(p): p for p in hit}.values()))
                finally:
                    STATE.busy -= 1
        out = func(*args, **kwargs)
        if _name(func) == "data" and getattr(func, "__name__", "") == "__set__" and not STATE.busy:
            p = args[0]                              # `param.data = new` on a partitioned parameter
            if zp.held_by_init(p) and all(q is not p for q in self.ctx.full):   # `in` would compare values
                p.ds_status = ZeroParamStatus.AVAILABLE
                self.ctx.full.append(p)
        return out
