"""A training layout — dp × tp × pp, ZeRO stage, offload, micro-batch, recomputation,
interleaving, sequence parallelism — and every legal one for a model on N accelerators.

    python -m planner llama-7b --gpus 64 --hardware a100 --json layouts.json

Rank placement as Megatron-LM orders it (tp fastest, then dp, then pp): a tensor-parallel group
sits inside one node, a data-parallel group strides over tp and spans nodes once tp·dp exceeds a
node, pipeline neighbours are tp·dp ranks apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 0                 # ZeRO stage over the dp group (1 = Megatron's distributed optimizer)
    offload: bool = False         # ZeRO-Offload: fp32 master + Adam states on the host, Adam on the host
    mb: int = 1                   # micro-batch size, sequences
    recompute: str = "none"       # none | selective (Korthikanti: the attention core) | full (every layer)
    v: int = 1                    # interleaved pipeline: model chunks per stage
    sp: bool = False              # Megatron sequence parallelism (needs tp > 1)

    def __post_init__(self):
        bad = [f"{k}={getattr(self, k)}" for k in ("dp", "tp", "pp", "mb", "v") if getattr(self, k) < 1]
        if bad or self.zero not in (0, 1, 2, 3) or self.recompute not in RECOMPUTE:
            raise ValueError(f"invalid layout: {bad or (self.zero, self.recompute)}")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mb)

    def label(self) -> str:
        extra = [f"Z{self.zero}" + ("+off" if self.offload else ""), f"mb{self.mb}",
                 {"none": "", "selective": "rs", "full": "rf"}[self.recompute],
                 f"v{self.v}" if self.v > 1 else "", "sp" if self.sp else ""]
        return f"dp{self.dp}·tp{self.tp}·pp{self.pp} " + " ".join(e for e in extra if e)

    def as_dict(self) -> dict:
        return asdict(self)


def why_not(model, lay: Layout, gpus: int, per_node: int, global_batch: int, host_offload: bool = True) -> str:
    """'' when the layout is legal for this model, batch and cluster; else the reason."""
    if lay.gpus != gpus:
        return f"dp·tp·pp = {lay.gpus} ≠ {gpus} GPUs"
    if lay.tp > per_node or per_node % lay.tp:
        return f"tp {lay.tp} must divide the {per_node} GPUs of a node"
    if model.heads % lay.tp or model.kv % lay.tp:
        return f"tp {lay.tp} must divide heads {model.heads} and kv heads {model.kv}"
    if model.layers % (lay.pp * lay.v):
        return f"pp·v = {lay.pp * lay.v} must divide {model.layers} layers"
    if global_batch % (lay.dp * lay.mb):
        return f"global batch {global_batch} is not a multiple of dp·mb = {lay.dp * lay.mb}"
    if lay.v > 1 and (lay.pp == 1 or lay.micro_batches(global_batch) % lay.pp):
        return "interleaving needs pp > 1 and micro-batches a multiple of pp"
    if lay.zero and lay.dp == 1:
        return "ZeRO shards over dp: with dp = 1 it is ZeRO-0"
    if lay.sp and lay.tp == 1:
        return "sequence parallelism needs tp > 1"
    if lay.zero >= 2 and lay.pp > 1:
        return "ZeRO-2/3 shard gradients that pipeline micro-batches accumulate (DeepSpeed refuses it)"
    if lay.offload and (lay.zero == 0 or not host_offload):
        return "offload needs ZeRO ≥ 1 and a host apart from the device"
    return ""


def check_fixed(fixed: dict) -> None:
    """Refuse a pinned field that is not a Layout's, or a value it cannot take, naming both."""
    names = [f.name for f in fields(Layout)]
    for k, v in fixed.items():
        if k not in names:
            raise ValueError(f"fixed field {k!r} is not a layout field: one of {', '.join(names)}")
        if k == "recompute":
            ok = v in RECOMPUTE
        elif k in ("offload", "sp"):
            ok = isinstance(v, bool)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and (v in (0, 1, 2, 3) if k == "zero" else v >= 1)
        if not ok:
            want = {"recompute": " | ".join(RECOMPUTE), "offload": "true | false", "sp": "true | false",
                    "zero": "0, 1, 2 or 3"}.get(k, "a positive integer")
            raise ValueError(f"fixed {k}={v!r}: expected {want}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model, gpus: int, per_node: int, global_batch: int, host_offload: bool = True,
                      mbs=(1, 2, 4, 8), zeros=(0, 1, 2, 3), recomputes=RECOMPUTE, max_v: int = 64,
                      fixed: dict | None = None):
    """Every legal layout (interleaving: v chunks of whole layers, v ≤ max_v); `fixed` pins fields
    (e.g. {"tp": 8, "pp": 2} for a published run; dp too, as gpus / (tp·pp)), each checked first."""
    fixed = fixed or {}
    check_fixed(fixed)
    pick = lambda k, opts: [fixed[k]] if k in fixed else list(opts)  # noqa: E731
    for tp in pick("tp", [t for t in divisors(per_node) if gpus % t == 0]):
        for pp in pick("pp", [p for p in divisors(gpus // tp) if model.layers % p == 0]):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if fixed.get("dp", dp) != dp:
                continue
            for zero in pick("zero", zeros):
                for offload in pick("offload", (False, True)):
                    for mb in pick("mb", mbs):
                        for rc in pick("recompute", recomputes):
                            for v in pick("v", [d for d in divisors(model.layers // pp) if d <= max_v] if pp > 1 else (1,)):
                                for sp in pick("sp", (False, True) if tp > 1 else (False,)):
                                    lay = Layout(dp, tp, pp, zero, offload, mb, rc, v, sp)
                                    if not why_not(model, lay, gpus, per_node, global_batch, host_offload):
                                        yield lay


def why_none(model, gpus: int, per_node: int, global_batch: int, host_offload: bool = True,
             fixed: dict | None = None) -> str:
    """Why no layout is legal, as the pinned fields' own layout (the rest at their defaults, dp =
    gpus / (tp·pp)) fails why_not; '' when that one is legal."""
    fixed = fixed or {}
    tp, pp = fixed.get("tp", 1), fixed.get("pp", 1)
    if gpus % (tp * pp):
        return f"tp·pp = {tp * pp} does not divide {gpus} GPUs"
    try:
        lay = Layout(fixed.get("dp", gpus // (tp * pp)), tp, pp, **{k: v for k, v in fixed.items() if k not in ("dp", "tp", "pp")})
    except ValueError as e:
        return str(e)
    return why_not(model, lay, gpus, per_node, global_batch, host_offload)
