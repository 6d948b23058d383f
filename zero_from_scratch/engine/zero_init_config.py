"""zero.Init's configuration: the dict or JSON path, the dtype it names, and whether shards go to files.

    cfg = _load("ds_config.json"); _dtype_from(cfg) → torch.bfloat16; _swap_from(cfg, None, True) → InitSwap

As DeepSpeed 0.19.8's Init reads them (runtime/zero/partition_parameters.py): bf16/fp16 "enabled"
gives the dtype; offload_param.device wins over remote_device; nvme needs offload_param.nvme_path.
Cost: one JSON read.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from zero_from_scratch.engine.init_swap import InitSwap


def _load(cfg):
    if isinstance(cfg, str):
        with open(cfg) as f:
            cfg = json.load(f)
    cfg = getattr(cfg, "config", cfg)            # HfDeepSpeedConfig / objects holding the dict
    if cfg is not None and not isinstance(cfg, dict):
        raise TypeError(f"Init(config_dict_or_path=...) must be a dict or a JSON path, got {type(cfg).__name__}")
    return cfg


def _dtype_from(cfg: dict | None) -> torch.dtype | None:
    if cfg is None:
        return None
    on = {k: (cfg.get(k) or {}).get("enabled", False) for k in ("bf16", "bfloat16", "fp16")}
    bad = [k for k, v in on.items() if v not in (True, False)]
    if bad:
        raise ValueError(f"Init: {bad[0]}.enabled={on[bad[0]]!r} is unresolved; resolve \"auto\" before Init "
                         "(transformers' HfDeepSpeedConfig does)")
    if (on["bf16"] or on["bfloat16"]) and on["fp16"]:
        raise ValueError("Init: bf16 and fp16 cannot be enabled at once (DeepSpeed raises the same)")
    return torch.bfloat16 if (on["bf16"] or on["bfloat16"]) else torch.float16 if on["fp16"] else torch.float32


def _swap_from(cfg: dict | None, remote_device, enabled: bool):
    """An InitSwap when the shards go to files (offload_param.device wins over remote_device, as in DeepSpeed)."""
    off = ((cfg or {}).get("zero_optimization") or {}).get("offload_param") or {}
    device = off.get("device", remote_device) if off else remote_device
    if device != "nvme" or not enabled:
        return None
    if not off.get("nvme_path"):
        raise ValueError("zero.Init with nvme (remote_device or offload_param.device) needs config_dict_or_path with "
                         "zero_optimization.offload_param.nvme_path (DeepSpeed asserts the same); or build with "
                         "remote_device None/'cpu' and let initialize's offload_param move the shards")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return InitSwap(off["nvme_path"], rank)
