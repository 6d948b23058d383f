"""`ds_tensor` of a ZeRO-3 parameter whose partition the engine does not store: shape and dtype only.

    engine, *_ = zero_from_scratch.initialize(model=model, config={... "zero_optimization": {"stage": 3}})
    p.ds_tensor.shape        # torch.Size([ceil(p.ds_numel / N)]), DeepSpeed's per-rank partition
    safe_get_local_fp32_param(p)   # its values (safe_api.py)

DeepSpeed's ZeRO-3 keeps each parameter's rank-r partition (ceil(numel/N) elements) in ds_tensor;
the engine here shards each module's parameters as one flat buffer instead (the textbook's layout,
stage3.py). A parameter alone in its module has its partition as this rank's shard, a real tensor
(z3_ds_tensor.py); for the others no tensor holds it, and ds_tensor is this meta tensor.
Scripts and DeepSpeed's tests read ds_tensor's shape, numel and dtype (and ds_tensor.ds_numel):
those answer as DeepSpeed's would. Anything reading or writing values raises, saying why this
parameter has no storage and which do, and naming safe_get/set_local_* (a silent meta tensor would
drop writes). Cost: none (a meta tensor).
"""
from __future__ import annotations

import torch

_METADATA = {"shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device", "is_floating_point",
             "element_size", "__repr__", "__format__", "__len__", "is_meta",
             "layout", "requires_grad", "_make_subclass"}


class PartitionShape(torch.Tensor):
    """A meta tensor shaped as DeepSpeed's partition; its values are not here (see the module docstring)."""

    @staticmethod
    def of(numel: int, world: int, dtype: torch.dtype, why: str = "") -> "PartitionShape":
        return PartitionShape._sized(-(-numel // world), dtype, why)

    @staticmethod
    def _sized(shard: int, dtype: torch.dtype, why: str = "") -> "PartitionShape":
        t = torch.Tensor._make_subclass(PartitionShape, torch.empty(shard, dtype=dtype, device="meta"))
        t.ds_numel, t.why = shard, why
        return t

    def __deepcopy__(self, memo):      # copy.deepcopy(model) after initialize: another shape-only partition
        return PartitionShape._sized(self.ds_numel, self.dtype, self.why)

    def __reduce_ex__(self, protocol):
        return PartitionShape._sized, (self.ds_numel, self.dtype, self.why)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA:
            why = next((a.why for a in args if isinstance(a, PartitionShape) and a.why), "")
            raise NotImplementedError(
                f"ds_tensor.{name}: ringzero's ZeRO-3 shards each module's parameters as one flat buffer (the textbook's "
                "layout) where DeepSpeed pads and splits each parameter, so this partition has DeepSpeed's shape here but "
                f"no storage of its own{': ' + why if why else ''}; read or write the parameter inside "
                "deepspeed.zero.GatheredParameters([p], modifier_rank=0), or its fp32 partition with "
                "deepspeed.utils.safe_get_local_fp32_param / safe_set_local_fp32_param")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
