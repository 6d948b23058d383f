"""ZeRO++ quantised weight communication (qwZ, arXiv 2306.10209 §3.1): at stage 3 each rank
quantises its weight shard block-wise to int8 before the all-gather; what arrives is dequantised
into the gathered unit. The shard itself stays the full-precision master: only the gathered,
short-lived copy that forward and backward compute with is quantised.

    {"zero_optimization": {"stage": 3, "zero_quantized_weights": true}}
    python -m pytest tests/test_zero_pp.py -k qwz

Per unit of P (padded) elements, s = P/N per rank, B = 4096, ring all-gather:
  plain ZeRO-3   (N-1)·s·b bytes sent per all-gather (b = 4 fp32, 2 bf16/fp16)
  qwZ            (N-1)·(s + 4·ceil(s/B)) bytes: int8 codes + fp32 block scales, one buffer
                 -> ¼ of fp32's bytes (+0.1 % scales), ½ of bf16's
Both all-gathers (forward and backward) are quantised, as in DeepSpeed; gathered_parameters and
its modifier_rank write-back gather in full precision (DeepSpeed's GatheredParameters does too),
so reading or saving weights is exact. With hpZ (hpz.py) the secondary shard keeps the int8
bytes. Error: every weight used in forward/backward is within s_block/2 of the master
(quantize.py), s_block = max|w| / 127 over its block of 4096. The optimizer steps the exact
master, so rounding does not accumulate over steps. B = 4096 is DeepSpeed 0.19.8's choice
(CUDAQuantizer: groups of at most ~8k elements, "the optimal size is 4k"; its scales travel in a
second all-gather, here in the same buffer, same bytes): the scales cost 0.1 % against 1.6 % at
B = 256, which moved the MLP benchmark's loss by the same amount within its run-to-run noise.
Cost: an encode of s elements and a decode of P elements per gather (elementwise, local).
"""
from __future__ import annotations

import functools

import torch

from zero_from_scratch.engine.quantize import Spec, decode_rows, encode_rows

SPEC = Spec(bits=8, block=4096, symmetric=True)   # DeepSpeed's group size (see above)
KINDS = ("forward", "backward")       # gathered_parameters ("gather_ctx") stays exact


class QwZ:
    def __init__(self, stage, spec: Spec = SPEC):
        self.st, self.spec = stage, spec

    def wire(self, u) -> int:
        """Bytes of one rank's quantised shard of u."""
        return self.spec.wire_bytes(u.shard)

    def _encode(self, u) -> torch.Tensor:
        st = self.st
        if st.poff is not None and st.poff.owns(u):     # offload_param: read in, quantise, let go (DeepSpeed
            shard = torch.empty(u.shard, dtype=st.dtype, device=st.dev)   # quantises the shard it moved to
            st.poff.read_into(u, shard)                                    # the device)
        else:
            shard = st.param_shard(u)
        return encode_rows(shard.view(1, -1), self.spec).view(-1)

    def _decode(self, u, buf: torch.Tensor, full: torch.Tensor) -> None:
        n = self.st.comm.size
        decode_rows(buf.view(n, -1), u.shard, self.spec, out=full.view(n, u.shard))

    def fetch(self, u, kind: str, full: torch.Tensor) -> None:
        """Fill `full` (u.padded elements): the int8 all-gather, or hpZ's group all-gather of the
        int8 secondary shards in backward; then dequantise."""
        st, hp = self.st, self.st.hpz
        buf = torch.empty(st.comm.size * self.wire(u), dtype=torch.uint8, device=full.device)
        if not (hp and hp.gather(u, kind, buf, st.tag)):
            st.comm.all_gather_single(buf, self._encode(u), **st.kw(f"param all-gather ({kind}, int8)", u))
            if hp:
                hp.keep(u, buf)
        self._decode(u, buf, full)

    def start(self, u, kind: str, tag: int):
        """Prefetch: the int8 all-gather (hpZ's group all-gather in backward), asynchronous; (wait,
        full) as ZeroStage3._start_prefetch. wait() also dequantises (and keeps hpZ's slice)."""
        st, hp = self.st, self.st.hpz
        buf = torch.empty(st.comm.size * self.wire(u), dtype=torch.uint8, device=st.dev)
        full = torch.empty(u.padded, dtype=st.dtype, device=st.dev)
        h = hp.gather(u, kind, buf, tag, async_op=True) if hp else None      # backward: inside the node
        if h is not None:
            return functools.partial(st.comm.wait, h, lambda: self._decode(u, buf, full)), full
        h = st.comm.all_gather_single(buf, self._encode(u), purpose=f"param all-gather ({kind}, int8)", tag=tag,
                                      async_op=True, what=u.tag)

        def arrived():
            if hp:
                hp.keep(u, buf)
            self._decode(u, buf, full)
        return functools.partial(st.comm.wait, h, arrived), full


def make(stage, engine):
    """QwZ when the key is on and there is someone to gather from (N = 1 gathers nothing, as in DeepSpeed)."""
    return QwZ(stage) if engine.config.zeropp.quantized_weights and stage.comm.size > 1 else None


def allgather_bytes(unit_padded: list, n: int, spec: Spec = SPEC) -> int:
    """Bytes one rank sends in ONE quantised ring all-gather of every unit: (N-1)·wire(s)."""
    return sum((n - 1) * spec.wire_bytes(p // n) for p in unit_padded) if n > 1 else 0
