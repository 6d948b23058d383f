"""zero.Init's `weight_quantization.quantized_initialization`: Linear / Embedding weights kept as int8/int4 codes.

    cfg["weight_quantization"] = {"quantized_initialization": {"num_bits": 8, "group_size": 64, "group_dim": 1,
                                                               "symmetric": False}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):   # under python -m zero_from_scratch.as_deepspeed
        model = build()                                  # each Linear/Embedding weight: codes + scales + minima
    with deepspeed.zero.GatheredParameters(model.parameters()):
        y = model(x)                                     # F.linear / F.embedding dequantise the weight first

As DeepSpeed 0.19.8 (inference/quantization/utils.py, called from runtime/zero/partition_parameters.py):
when a torch.nn.Linear or Embedding (those exact classes) is built inside Init, its `weight` is
quantised before it is partitioned: asymmetric (DeepSpeed asserts symmetric is false), groups of
group_size consecutive elements along group_dim, per group s = (max - min)/(2^b - 1), z = min,
code = round((x - z)/s), x^ = z + code·s (|x - x^| <= s/2, plus the dtype's rounding); int4 packs two
codes per byte along the last dim. The parameter's data becomes one flat tensor of its dtype holding
the codes', scales' and minima's bytes
(`deconcat` splits it), and the parameter gets `weight_quantized`, `quantizer`, `dequantizer`. On
entering the outermost Init (with memory_efficient_linear on, as DeepSpeed) F.linear and F.embedding
are wrapped to dequantise such a weight before the call, and Linear / Embedding's
_load_from_state_dict to quantise an incoming full weight; nothing restores them (DeepSpeed neither).
The arithmetic is DeepSpeed's, in the parameter's dtype (fp16/bf16 rounding included): it stores
1/s = (2^b - 1)/(max - min) and z, codes = round(clamp((x - z)·(1/s), 0, 2^b - 1)), x^ = code/(1/s) + z;
deconcat gives the codes in the weight's shape and 1/s, z in group shapes (group_dim split into
groups × 1), as DeepSpeed's. DeepSpeed's fused CUDA dequantise kernel (fp16, group_dim last, on an
accelerator) is not used: the torch formula runs everywhere. Memory: a weight of n elements of b
bytes takes n·bits/8 bytes of codes + 2b bytes per group. Cost: one pass to quantise; one to
dequantise per use.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

WEIGHT_QUANTIZATION_LAYERS = (nn.Linear, nn.Embedding)


def _check(config: dict) -> dict:
    assert config["num_bits"] in (4, 8), "Only INT4 and INT8 quantization is supported."
    assert config["symmetric"] is False, "Only asymmetric quantization is supported at this moment."
    return config


def _grouped(tensor: torch.Tensor, config: dict) -> torch.Tensor:
    """A view with group_dim split into (groups, group_size): the statistics run along group_dim + 1."""
    gd, gs, shape = config["group_dim"], config["group_size"], tensor.shape
    return tensor.view(shape[:gd] + (shape[gd] // gs, gs) + shape[gd + 1:])


class Quantizer:
    """tensor → (uint8 codes in its shape, 1/s and min per group in group shapes, both in the tensor's dtype)."""

    def __init__(self, config: dict) -> None:
        self.config = _check(config)

    def quantize(self, tensor: torch.Tensor):
        gd, top = self.config["group_dim"], 2 ** self.config["num_bits"] - 1
        assert tensor.shape[gd] % self.config["group_size"] == 0, \
            f"Tensor shape: {tensor.shape} quantization config {self.config}"
        g = _grouped(tensor.detach().clone(), self.config)
        lo, hi = g.amin(dim=gd + 1, keepdim=True), g.amax(dim=gd + 1, keepdim=True)
        scale = top / (hi - lo)                              # DeepSpeed keeps 1/s, in the tensor's dtype
        codes = g.sub_(lo).mul_(scale).clamp_(0, top).round_().to(torch.uint8).view(tensor.shape)
        if self.config["num_bits"] == 4:                     # two codes a byte along the last dim, the even one high
            codes = codes[..., 0::2] << 4 | codes[..., 1::2]
        return codes, scale, lo


class DeQuantizer:
    """The inverse: codes (in the weight's shape) / scale + min, in the parameter's dtype."""

    def __init__(self, config: dict, dtype: torch.dtype) -> None:
        self.config, self.dtype = _check(config), dtype

    def dequantize(self, tensor: torch.Tensor, quant_scale: torch.Tensor, quant_min: torch.Tensor) -> torch.Tensor:
        if self.config["num_bits"] == 4:
            tensor = torch.stack([tensor >> 4, tensor & 15], dim=-1).reshape(*tensor.shape[:-1], -1)
        data = _grouped(tensor.to(self.dtype), self.config)
        return (data / quant_scale + quant_min).view(tensor.shape)


def concat_to_compat_param(codes, scale, minimum, dtype) -> torch.Tensor:
    """One flat tensor of `dtype` holding the three (codes viewed as dtype along their last dim, as DeepSpeed);
    `.deconcat(t)` gives them back in their shapes."""
    parts = [p.view(dtype) for p in (codes, scale, minimum)]
    shapes = [p.shape for p in parts]
    compat = torch.cat([p.reshape(-1) for p in parts])

    def deconcat(t):
        return tuple(p.view(sh) for p, sh in zip(torch.split(t, [sh.numel() for sh in shapes]), shapes))
    compat.deconcat = deconcat
    return compat


def _quantize_param(param: nn.Parameter, quant_config: dict) -> None:
    assert not hasattr(param, "weight_quantized"), "Parameter has already been quantized."
    param.quantizer = Quantizer(quant_config)
    param.dequantizer = DeQuantizer(quant_config, param.dtype)
    compat = concat_to_compat_param(*param.quantizer.quantize(param.data), dtype=param.dtype)
    param.data = compat
    param.deconcat = compat.deconcat
    param.weight_quantized = True


def wrap_quantized_functional(f):
    """F.linear / F.embedding: a quantised weight is dequantised for the call, anything else passes."""
    @functools.wraps(f)
    def wrapper(input, weight, *args, **kwargs):
        if getattr(weight, "weight_quantized", False):
            codes, scale, minimum = weight.deconcat(weight)
            weight = weight.dequantizer.dequantize(codes.view(torch.uint8), scale, minimum)
        return f(input, weight, *args, **kwargs)
    return wrapper


def wrap_load_from_state_dict(f):
    """A full-precision weight in a state dict is quantised before it is copied into a quantised parameter."""
    @functools.wraps(f)
    def wrapper(model, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        key, old = prefix + "weight", None
        w = getattr(model, "weight", None)
        if getattr(w, "weight_quantized", False) and not hasattr(w, "state_dict_quantized") and key in state_dict:
            w.state_dict_quantized = True        # nested wrappers (several Init contexts) quantise once
            old = state_dict[key]
            state_dict[key] = concat_to_compat_param(*w.quantizer.quantize(old), dtype=w.dtype)
        try:
            f(model, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        finally:
            if old is not None:
                state_dict[key] = old
                del w.state_dict_quantized
    return wrapper


def patch_functionals() -> None:
    """DeepSpeed's patch when the outermost Init is entered: wrappers over whatever F.linear / F.embedding are."""
    nn.functional.linear = wrap_quantized_functional(nn.functional.linear)
    nn.functional.embedding = wrap_quantized_functional(nn.functional.embedding)
    for cls in WEIGHT_QUANTIZATION_LAYERS:
        cls._load_from_state_dict = wrap_load_from_state_dict(cls._load_from_state_dict)
