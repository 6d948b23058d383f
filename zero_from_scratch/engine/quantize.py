"""Block-wise quantisation, the arithmetic under ZeRO++ (arXiv 2306.10209): qwZ's int8 weights
(§3.1, "block-based quantization") and qgZ's int4 gradients (§3.3).

    wire = encode_rows(x.view(p, m), Spec(bits=8))       # p rows, each quantised on its own
    y = decode_rows(wire, m, Spec(bits=8))               # (p, m) fp32
    python -m pytest tests/test_zero_pp.py -k quantiser   (no processes)

A row of m elements is cut into blocks of B consecutive elements (the last may be shorter). Each
block has its own fp32 scale, so an outlier coarsens only its own block (one scale for the whole
tensor is what the paper shows failing):
  symmetric    s = max|x| / q,  code = round(x / s) in [-q, q],  x^ = code·s     (q = 127 int8, 7 int4)
  asymmetric   s = (max-min) / (2^b - 1),  z = min,  code = round((x - z) / s) in [0, 2^b - 1],  x^ = z + code·s
Round to nearest: |x - x^| <= s/2 for every element, and a value on its block's grid (code·s, or
z + code·s) comes back exactly. A block of zeros gets s = 1 (codes 0, exact).
Wire format, one uint8 row per input row (what the collectives move): the codes, ceil(m·b/8)
bytes (int4: two per byte, the even element in the low nibble, stored as code + 8 when
symmetric), then the scales as fp32 bytes (4·ceil(m/B)), then, asymmetric only, the zero points.
Bytes per element: int8 1 + 4/B, int4 1/2 + 4/B (fp32 4, bf16/fp16 2); symmetric, B = 256:
1.016 and 0.516. Cost: a few elementwise passes per encode/decode; nothing is communicated here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Spec:
    bits: int = 8              # 8 (int8) or 4 (int4, packed two per byte)
    block: int = 256           # B: elements per scale
    symmetric: bool = True     # DeepSpeed's qwZ/qgZ kernels are symmetric

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"quantisation bits = {self.bits!r}; allowed: 4 or 8")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"quantisation block = {self.block!r}; allowed: an int >= 1")

    def code_bytes(self, m: int) -> int:
        return math.ceil(m * self.bits / 8)

    def blocks(self, m: int) -> int:
        return math.ceil(m / self.block)

    def wire_bytes(self, m: int) -> int:
        """Bytes one row of m elements takes on the wire: codes + fp32 scales (+ zero points)."""
        return self.code_bytes(m) + 4 * self.blocks(m) * (1 if self.symmetric else 2)


def _blocked(x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """(p, m) -> (p, nb, B) fp32; the last block padded with its row's last value (changes no max/min)."""
    p, m = x.shape
    nb = spec.blocks(m)
    x = x.float()
    if nb * spec.block != m:
        x = F.pad(x.unsqueeze(1), (0, nb * spec.block - m), mode="replicate").squeeze(1)
    return x.reshape(p, nb, spec.block)


def quantize_rows(x: torch.Tensor, spec: Spec):
    """(p, m) float -> (codes int16 (p, m), scales fp32 (p, nb), zeros fp32 (p, nb) or None)."""
    p, m = x.shape
    xb = _blocked(x, spec)
    if spec.symmetric:
        q = 2 ** (spec.bits - 1) - 1
        s = xb.abs().amax(dim=2) / q
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.round(xb / s.unsqueeze(2)).clamp_(-q, q)
        z = None
    else:
        lo, hi = xb.amin(dim=2), xb.amax(dim=2)
        s = (hi - lo) / (2 ** spec.bits - 1)
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.round((xb - lo.unsqueeze(2)) / s.unsqueeze(2)).clamp_(0, 2 ** spec.bits - 1)
        z = lo
    return codes.reshape(p, -1)[:, :m].to(torch.int16), s, z


def dequantize_rows(codes: torch.Tensor, s: torch.Tensor, z, spec: Spec) -> torch.Tensor:
    """The inverse of quantize_rows: (p, m) fp32."""
    p, m = codes.shape
    nb = s.shape[1]
    c = F.pad(codes.float(), (0, nb * spec.block - m)).reshape(p, nb, spec.block)
    y = c * s.unsqueeze(2)
    if z is not None:
        y = y + z.unsqueeze(2)
    return y.reshape(p, -1)[:, :m]


def encode_rows(x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """(p, m) float -> (p, spec.wire_bytes(m)) uint8: each row quantised on its own."""
    p, m = x.shape
    codes, s, z = quantize_rows(x, spec)
    if spec.bits == 8:
        c = (codes if spec.symmetric else codes - 128).to(torch.int8).view(torch.uint8)
    else:
        u = (codes + 8 if spec.symmetric else codes).to(torch.uint8)
        if m % 2:
            u = F.pad(u, (0, 1))
        c = u[:, 0::2] | (u[:, 1::2] << 4)
    parts = [c, s.contiguous().view(torch.uint8)] + ([z.contiguous().view(torch.uint8)] if z is not None else [])
    return torch.cat(parts, dim=1)


def decode_rows(wire: torch.Tensor, m: int, spec: Spec, out: torch.Tensor | None = None) -> torch.Tensor:
    """(p, wire_bytes(m)) uint8 -> (p, m) values; written into `out` (any float dtype) when given."""
    p = wire.shape[0]
    cb, nb = spec.code_bytes(m), spec.blocks(m)
    c = wire[:, :cb]
    if spec.bits == 8:
        codes = _own(c).view(torch.int8).to(torch.int16) + (0 if spec.symmetric else 128)
    else:
        codes = torch.stack([c & 15, c >> 4], dim=2).reshape(p, -1)[:, :m].to(torch.int16) - (8 if spec.symmetric else 0)
    s = _own(wire[:, cb:cb + 4 * nb]).view(torch.float32)
    z = _own(wire[:, cb + 4 * nb:cb + 8 * nb]).view(torch.float32) if not spec.symmetric else None
    y = dequantize_rows(codes, s, z, spec)
    if out is None:
        return y
    out.copy_(y.view(out.shape))
    return out


def round_trip(x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """x quantised and back (same shape, fp32): what the receiver of x's wire bytes sees."""
    flat = x.reshape(1, -1)
    return decode_rows(encode_rows(flat, spec), flat.shape[1], spec).view(x.shape)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy at offset 0, so its bytes can be reinterpreted (view(float32))."""
    return t.clone(memory_format=torch.contiguous_format)
