"""ZeRO++'s keys in zero_optimization (arXiv 2306.10209), read and checked at start-up:

    zero_quantized_weights     qwZ: int8 weight all-gathers (qwz.py)
    zero_quantized_gradients   qgZ: int4 all-to-all gradient reduction (qgz.py)
    zero_hpz_partition_size    hpZ: secondary weight shards inside a node (hpz.py, checked there)

    python -c "from zero_from_scratch.engine.zeropp import parse; print(parse({'stage': 3, 'zero_quantized_weights': True}, 2))"

All three act at stage 3 only, as in DeepSpeed 0.19.8 (its stage 1/2 optimizers never read the
quantisation keys): set at another stage, they are accepted with a start-up warning saying so.
Cost: a dict lookup.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zero_from_scratch.engine.hpz import check_config as check_hpz

KEYS = ("zero_quantized_weights", "zero_quantized_gradients")


@dataclass
class ZeroPP:
    quantized_weights: bool = False        # qwZ: weights all-gathered as int8 + block scales
    quantized_gradients: bool = False      # qgZ: gradients reduced by int4 all-to-alls
    notes: list = field(default_factory=list)   # start-up warnings (set but without effect)


def parse(z: dict, stage: int) -> ZeroPP:
    """ZeroPP from the zero_optimization dict z (stage = its stage)."""
    vals = {}
    for k in KEYS:
        v = z.get(k, False)
        if not isinstance(v, bool):
            raise ValueError(f"config key 'zero_optimization.{k}' = {v!r} is invalid; allowed: true or false")
        vals[k] = v
    out = ZeroPP(vals["zero_quantized_weights"], vals["zero_quantized_gradients"])
    if stage != 3:
        out.notes = [f"zero_optimization.{k} = true: no effect at stage {stage}; DeepSpeed reads it at stage 3 "
                     "only (ZeRO++ quantises ZeRO-3's collectives)" for k in KEYS if vals[k]]
        out.quantized_weights = out.quantized_gradients = False
    return out


def check(zero, z: dict, world_size: int) -> ZeroPP:
    """The ZeRO++ checks of load_config: hpZ's size (hpz.py), then the quantisation switches;
    their notes join zero.notes (printed at initialise)."""
    check_hpz(zero, world_size)
    pp = parse(z, zero.stage)
    zero.notes = tuple(zero.notes) + tuple(pp.notes)
    return pp
