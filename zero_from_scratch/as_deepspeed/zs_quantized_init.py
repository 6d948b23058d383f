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
code = round((x - z)/s), x^ = z + code·s (|x - x^| <= s/2); int4 packs two codes per byte. The
parameter's data becomes one flat tensor of its dtype holding the codes', scales' and minima's bytes
(`deconcat` splits it), and the parameter gets `weight_quantized`, `quantizer`, `dequantizer`. On
entering the outermost Init (with memory_efficient_linear on, as DeepSpeed) F.linear and F.embedding
are wrapped to dequantise such a weight before the call, and Linear / Embedding's
_load_from_state_dict to quantise an incoming full weight; nothing restores them (DeepSpeed neither).
The arithmetic is ringzero's block quantiser (engine/quantize.py), the one its qwZ uses; the bytes'
layout is this file's (DeepSpeed stores 1/s, not s). Memory: a weight of n elements of b bytes takes
n·bits/8 bytes of codes + 8 bytes per group. Cost: one pass to quantise; one to dequantise per use.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from zero_from_scratch.engine.quantize import Spec, dequantize_rows, quantize_rows

WEIGHT_QUANTIZATION_LAYERS = (nn.Linear, nn.Embedding)


def _check(config: dict) -> dict:
    assert config["num_bits"] in (4, 8), "Only INT4 and INT8 quantization is supported."
    assert config["symmetric"] is False, "Only asymmetric quantization is supported at this moment."
    return config


class Quantizer:
    """tensor → (uint8 codes, fp32 scales s, fp32 minima z), groups of group_size along group_dim."""

    def __init__(self, config: dict) -> None:
        self.config = _check(config)

    def quantize(self, tensor: torch.Tensor):
        gd, gs = self.config["group_dim"], self.config["group_size"]
        assert tensor.shape[gd] % gs == 0, f"Tensor shape: {tensor.shape} quantization config {self.config}"
        rows = tensor.detach().movedim(gd, -1).reshape(-1, tensor.shape[gd])
        codes, s, z = quantize_rows(rows, Spec(bits=self.config["num_bits"], block=gs, symmetric=False))
        codes = codes.to(torch.uint8).reshape(-1)
        if self.config["num_bits"] == 4:                   # two codes a byte, the even one high (DeepSpeed's)
            codes = codes[0::2] << 4 | codes[1::2]
        return codes, s, z


class DeQuantizer:
    """The inverse for one parameter: its shape and dtype kept from quantisation."""

    def __init__(self, config: dict, dtype: torch.dtype, shape: torch.Size) -> None:
        self.config, self.dtype, self.shape = _check(config), dtype, torch.Size(shape)

    def dequantize(self, tensor: torch.Tensor, quant_scale: torch.Tensor, quant_min: torch.Tensor) -> torch.Tensor:
        gd, gs = self.config["group_dim"], self.config["group_size"]
        codes = tensor.reshape(-1)
        if self.config["num_bits"] == 4:
            codes = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1)
        moved = self.shape[:gd] + self.shape[gd + 1:] + self.shape[gd:gd + 1]
        rows = codes.to(torch.int16).reshape(-1, self.shape[gd])
        s = quant_scale.contiguous().view(torch.float32).reshape(rows.shape[0], -1)
        z = quant_min.contiguous().view(torch.float32).reshape(rows.shape[0], -1)
        y = dequantize_rows(rows, s, z, Spec(bits=self.config["num_bits"], block=gs, symmetric=False))
        return y.reshape(moved).movedim(-1, gd).to(self.dtype)


def concat_to_compat_param(codes, scale, minimum, dtype) -> torch.Tensor:
    """One flat tensor of `dtype` holding the three byte strings; `.deconcat(t)` gives them back as dtype views."""
    parts = [p.contiguous().view(torch.uint8).reshape(-1).view(dtype) for p in (codes, scale, minimum)]
    sizes = [p.numel() for p in parts]
    compat = torch.cat(parts)

    def deconcat(t):
        return tuple(torch.split(t.reshape(-1), sizes))
    compat.deconcat = deconcat
    return compat


def _quantize_param(param: nn.Parameter, quant_config: dict) -> None:
    assert not hasattr(param, "weight_quantized"), "Parameter has already been quantized."
    param.quantizer = Quantizer(quant_config)
    param.dequantizer = DeQuantizer(quant_config, param.dtype, param.shape)
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
