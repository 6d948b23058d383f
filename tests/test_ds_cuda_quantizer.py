"""CUDAQuantizer served with DeepSpeed's kernel formula (zero_from_scratch/as_deepspeed/cuda_quantizer.py).

    python -m pytest -q tests/test_ds_cuda_quantizer.py

No processes (local arithmetic). The group counts are DeepSpeed 0.19.8's rule worked by hand; the
reference for the values is computed here independently from DeepSpeed's symmetric kernel
(quantization_utils.h): per group of the fp16 input (the kernel reads fp16), codes round(x·128/max|x|)
clamped to [-128, 127] (exact: the same fp32 operations), the stored scale max|x|/128 (to fp32
rounding), and every dequantised element within half a step of x (x - 127 steps where the code
clamps to 127), plus the rounding of the kernel's
fp16 output (2^-11 relative) and of the caller's dtype (half its eps). The caller's dtype comes back
(bf16, fp16, fp32). A group's maximum lands on code 127 (128 clamped), its negation on -128.
"""
import pytest
import torch

from zero_from_scratch.as_deepspeed.cuda_quantizer import CUDAQuantizer


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
    top = ref.abs().amax(dim=1, keepdim=True)
    assert torch.equal(codes.reshape(16, -1).float(), torch.round(ref * (256 / (2 * top))).clamp(-128, 127))
    s = top / 128
    torch.testing.assert_close(scale, s, rtol=2 ** -23, atol=0)
    err = (back.float().reshape(16, -1) - ref).abs()
    rounding = 2 ** -11 + torch.finfo(dtype).eps / 2             # fp16 out of the kernel, then the caller's dtype
    step = torch.maximum(s / 2, ref - 127 * s)                   # above 127.5 s the code clamps to 127
    assert (err <= step + (ref.abs() + s) * rounding + 1e-6).all()
    assert err.max() > 0                                         # it is quantised, not copied


def test_the_extremes_take_127_and_minus_128():
    x = torch.tensor([2.0, -2.0, 1.0, 0.0] * 2)
    codes, scale = CUDAQuantizer().quantize(x, groups=1)
    assert codes.tolist() == [127, -128, 64, 0] * 2 and scale.tolist() == [[2.0 / 128]]
    zero_codes, zero_scale = CUDAQuantizer().quantize(torch.zeros(8), groups=1)
    assert zero_codes.abs().sum() == 0 and zero_scale.tolist() == [[1.0]]
