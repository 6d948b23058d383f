"""`deepspeed.runtime.zero.partition_parameters.CUDAQuantizer`: int8 weights in groups (the kernel's formula in torch).

    q = CUDAQuantizer()
    codes, scale = q.quantize(param)                 # int8 codes (param's shape), fp32 scales (groups, 1)
    back = q.dequantize(codes, scale, dtype=param.dtype)

As DeepSpeed 0.19.8's class (what DeepSpeed's qwZ calls for each all-gather): quantize picks the
number of groups by DeepSpeed's rule (the fewest with numel/groups <= 8000 and numel divisible by
8·groups, doubled while that stays true and the groups exceed 8000; cached per numel), hands the
kernel fp16 (DeepSpeed's kernel reads __half*) and dequantize returns the kernel's fp16 in the
caller's dtype. The kernel (class attribute `quantizer_cuda_module`, which a caller may replace, as
DeepSpeed's tests do) is DeepSpeed's QuantizerBuilder op there, CUDA only; here TorchQuantizerModule
computes its symmetric int8 formula (ops/csrc/includes/quantization_utils.h, Params<Symmetric>):
per group, in fp32, s = 2^8/(2·max|x|) (1 when max is 0), code = clamp(round(x·s), -128, 127),
stored scale 1/s (= max|x|/128), x^ = code·(1/s) in fp16. This is not ringzero's own qwZ convention
(engine/quantize.py: max|x|/127, codes within ±127), which ringzero's engine uses and this class
does not. Cost: a few elementwise passes over the parameter; nothing is communicated.
"""
from __future__ import annotations

import math

import torch


class TorchQuantizerModule:
    """The QuantizerBuilder op's two calls, DeepSpeed's symmetric int8 kernel in torch (int4 / asymmetric refused)."""
    Symmetric = 0
    Asymmetric = 1

    @staticmethod
    def _check(num_bits: int, quant_type) -> None:
        if num_bits != 8 or quant_type != TorchQuantizerModule.Symmetric:
            raise NotImplementedError(f"quantize(num_bits={num_bits}, quant_type={quant_type}): ringzero's kernel here "
                                      "is symmetric int8 only (DeepSpeed's CUDA op also has int4 / asymmetric)")

    def quantize(self, param, groups, num_bits, quant_type):
        self._check(num_bits, quant_type)
        x = param.reshape(groups, -1).float()
        top = x.abs().amax(dim=1, keepdim=True)
        scale = torch.where(top == 0, torch.ones_like(top), 2 ** num_bits / (2 * top))
        codes = torch.round(x * scale).clamp_(-(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1)
        return codes.to(torch.int8).view(param.shape), 1 / scale

    def dequantize(self, quantized_param, scale, num_groups, num_bits, quant_type):
        self._check(num_bits, quant_type)
        y = quantized_param.reshape(num_groups, -1).float() * scale.reshape(num_groups, 1)
        return y.view(quantized_param.shape).to(torch.half)            # DeepSpeed's kernel writes fp16


class CUDAQuantizer:
    async_flag = True
    target_group_size = 8000       # DeepSpeed's: the best group is ~4k elements, kept below 8k
    group_size_cache: dict = {}
    quantizer_cuda_module = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = TorchQuantizerModule()

    def groups_for(self, numel: int) -> int:
        """DeepSpeed's adaptive group count for a tensor of numel elements (cached)."""
        if numel in self.group_size_cache:
            return self.group_size_cache[numel]
        groups = math.ceil(numel / self.target_group_size)
        while groups < numel and numel % (8 * groups):
            groups += 1
        while numel % (8 * groups * 2) == 0 and numel / groups > self.target_group_size:
            groups *= 2
        assert numel % (8 * groups) == 0, ("Qantized weight requires the number of weights be a multiple of 8. "
                                           f"Yet {numel} cannot be divided by 8*{groups}")
        assert numel / groups < 16000, f"{numel} / {groups} is larger than 16k"
        assert numel > groups, f"Adaptive grouping algorithm cannot find a group size for input tensor of size {numel}"
        self.group_size_cache[numel] = groups
        return groups

    def quantize(self, param, groups=None):
        groups = self.groups_for(param.numel()) if groups is None else groups
        param = param.to(dtype=torch.half)              # the kernel reads fp16 (DeepSpeed converts the same way)
        return self.quantizer_cuda_module.quantize(param, groups, 8, self.quantizer_cuda_module.Symmetric)

    def dequantize(self, quantized_param, scale, dtype=None):
        out = self.quantizer_cuda_module.dequantize(quantized_param, scale, scale.numel(), 8,
                                                    self.quantizer_cuda_module.Symmetric)
        return out.to(dtype) if dtype is not None and out.dtype != dtype else out
