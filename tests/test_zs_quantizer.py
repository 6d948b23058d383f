"""CUDAQuantizer served on ringzero's quantiser (zero_from_scratch/as_deepspeed/zs_quantizer.py).

    python -m pytest -q tests/test_zs_quantizer.py

No processes (local arithmetic). The group counts are DeepSpeed 0.19.8's rule worked by hand; the
reference for the values is computed here independently: per group s = max|x|/127 of the fp16 input
(the kernel reads fp16), and every dequantised element lies within s/2 of it, plus the rounding of
the kernel's fp16 output (2^-11 relative) and of the caller's dtype (half its eps). The caller's dtype comes back (bf16, fp16, fp32).
"""
import pytest
import torch

from zero_from_scratch.as_deepspeed.zs_quantizer import CUDAQuantizer


@pytest.mark.parametrize("numel,groups", [(4096, 1), (65536, 16), (1 << 20, 256), (128064, 23)])
def test_group_count_is_deepspeeds(numel, groups):
    assert CUDAQuantizer().groups_for(numel) == groups


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.half, torch.float32])
def test_round_trip_within_half_a_step_in_the_callers_dtype(dtype):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    q = CUDAQuantizer()
    codes, scale = q.quantize(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scale.numel() == 16
    back = q.dequantize(codes, scale, dtype=dtype)
    assert back.dtype == dtype
    ref = x.half().float().reshape(16, -1)
    s = ref.abs().amax(dim=1, keepdim=True) / 127
    err = (back.float().reshape(16, -1) - ref).abs()
    rounding = 2 ** -11 + torch.finfo(dtype).eps / 2             # fp16 out of the kernel, then the caller's dtype
    assert (err <= s / 2 + (ref.abs() + s / 2) * rounding + 1e-6).all()
    assert err.max() > 0                                         # it is quantised, not copied
