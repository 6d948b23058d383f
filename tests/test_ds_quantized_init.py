"""zero.Init with weight_quantization.quantized_initialization (as_deepspeed/quantized_init.py, under the runner's Init).

    python -m pytest -q tests/test_ds_quantized_init.py

Two ranks. The model (a Linear and an Embedding) is built inside the runner's zero.Init with int8
(groups of 4 along dim 1) and int4 (groups of 2 along dim 0) configs; its gathered Linear and
Embedding outputs are compared with an independent reference: the plain model under the same seed,
each weight group quantised here by DeepSpeed's formula (1/s = (2^b - 1)/(max - min), codes
round(clamp((x - min)·(1/s))), x^ = code/(1/s) + min), and torch's F.linear / F.embedding on x^
(tolerance 1e-6: the same fp32 operations, the matmul in another order). A state dict of full
weights loaded into the quantised Linear (rank 0 writing, GatheredParameters) is quantised on the
way in: the output then follows the new weights. One process, fp16 and bf16: the arithmetic runs in
the weight's dtype, so the dequantised weight equals the reference in that dtype exactly, and
deconcat gives the codes in the weight's shape and 1/s, min in group shapes (DeepSpeed's).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_from_scratch.as_deepspeed.zero_init import Init
from zero_from_scratch.engine.zero_init import GatheredParameters

TOL = dict(rtol=1e-6, atol=1e-6)
CONFIGS = ({"num_bits": 8, "group_size": 4, "group_dim": 1, "symmetric": False},
           {"num_bits": 4, "group_size": 2, "group_dim": 0, "symmetric": False})


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.emb = nn.Linear(8, 6), nn.Embedding(10, 8)


def reference(w: torch.Tensor, q: dict) -> torch.Tensor:
    gd, gs, top = q["group_dim"], q["group_size"], 2 ** q["num_bits"] - 1
    g = w.movedim(gd, -1).reshape(-1, gs)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    inv = top / (hi - lo)
    back = torch.round(((g - lo) * inv).clamp(0, top)) / inv + lo
    return back.reshape(w.movedim(gd, -1).shape).movedim(-1, gd)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_weights_quantise_in_their_dtype(dtype):
    from zero_from_scratch.as_deepspeed.quantized_init import _quantize_param
    for q, groups in zip(CONFIGS, ((6, 2, 1), (3, 1, 8))):
        w = nn.Parameter(torch.randn(6, 8, generator=torch.Generator().manual_seed(2)).to(dtype))
        ref = reference(w.detach(), q)
        _quantize_param(w, q)
        codes, inv, lo = w.deconcat(w)
        codes = codes.view(torch.uint8)
        assert codes.shape == ((6, 8) if q["num_bits"] == 8 else (6, 4))
        assert inv.shape == lo.shape == groups and inv.dtype == lo.dtype == dtype
        out = w.dequantizer.dequantize(codes, inv, lo)
        assert out.dtype == dtype and torch.equal(out, ref)


def _run(rank, world):
    x, ids = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([[1, 4, 9]])
    out = []
    for q in CONFIGS:
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
               "weight_quantization": {"quantized_initialization": q}}
        torch.manual_seed(0)
        with Init(config_dict_or_path=cfg, dtype=torch.float32):
            m = Model()
        quantised = [m.lin.weight.weight_quantized, m.emb.weight.weight_quantized, hasattr(m.lin.bias, "weight_quantized")]
        with GatheredParameters(list(m.parameters())):
            y, e = m.lin(x).detach(), m.emb(ids).detach()
        torch.manual_seed(5)
        new = nn.Linear(8, 6).state_dict()
        with GatheredParameters(list(m.lin.parameters()), modifier_rank=0):
            if rank == 0:
                m.lin.load_state_dict(new)
        with GatheredParameters(list(m.lin.parameters())):
            y_new = m.lin(x).detach()
        out.append((quantised, y, e, y_new, new))
    return x, ids, out


def test_quantized_initialization_equals_an_independent_dequantisation(spawn):
    torch.manual_seed(0)
    plain = Model()
    for x, ids, out in spawn(_run, 2):
        for q, (quantised, y, e, y_new, new) in zip(CONFIGS, out):
            assert quantised == [True, True, False]                   # weights only, as DeepSpeed
            w = reference(plain.lin.weight.detach(), q)
            assert not torch.equal(w, plain.lin.weight)               # quantised, not copied
            torch.testing.assert_close(y, F.linear(x, w, plain.lin.bias.detach()), **TOL)
            torch.testing.assert_close(e, F.embedding(ids, reference(plain.emb.weight.detach(), q)), **TOL)
            torch.testing.assert_close(y_new, F.linear(x, reference(new["weight"], q), new["bias"]), **TOL)
