"""Peak memory per accelerator of one layout: model states, activations, buffers, working set.

    python -m planner gpt-39b --gpus 512 --hardware a100 --json plan.json

Model states: the ZeRO paper's per-rank bytes (zero_from_scratch.engine.ledger.model_state_bytes,
arXiv 1910.02054) for the parameters one (tp, pp) shard holds; offload moves the fp32 master and
Adam's m, v to the host (ZeRO-Offload, arXiv 2101.06840).
Activations per layer and micro-batch: Korthikanti et al. 2022 (arXiv 2205.05198), eq. 1-5
(tensor_parallel.engine.formulas.megatron_activation_bytes), 16-bit activations:
    none       s·b·h·(34 + 5·a·s/h)  with the tp / sp divisions
    selective  the 5·a·s/h term (attention scores, softmax, its dropout) recomputed: s·b·h·34 (/t)
    full       only each layer's input kept: 2·s·b·h (/t with sp), plus one layer's activations
               rebuilt during its backward (working set)
The first pipeline stage holds min(p, m) micro-batches in flight (1F1B), L/p layers each, so
L layers' worth; interleaving with v chunks multiplies that by 1 + (p-1)/(p·v) (Korthikanti §4.2.3).
The last stage keeps the fp32 logits of one micro-batch, 4·s·b·V/t bytes (Korthikanti §4.3).
fp32 runs (bytes_per_elem 4) double the 16-bit activation bytes.
"""
from __future__ import annotations

from tensor_parallel.engine.formulas import megatron_activation_bytes
from zero_from_scratch.engine.ledger import model_state_bytes


def stage_params(model, lay, stage: str) -> int:
    """Parameters one rank of the first or last pipeline stage holds (after tp)."""
    t, p = lay.tp, lay.pp
    n = model.layers // p * model.layer_params() // t
    if stage == "first" or p == 1:
        n += model.embedding_params() // t
    if stage == "last" or p == 1:
        n += model.head_params() // t
        if model.tied and p > 1:
            n += model.vocab * model.hidden // t      # the last stage keeps its own copy of the tied embedding
    return n


def layer_activation_bytes(model, seq: int, lay, bpe: int, recompute: str | None = None) -> float:
    rc = recompute or lay.recompute
    s, b, h, a, t = seq, lay.mb, model.hidden, model.heads, lay.tp
    if rc == "full":
        x = 2 * s * b * h / (t if lay.sp else 1)
    elif rc == "selective":
        x = megatron_activation_bytes(s, b, h, 0, t, lay.sp)      # a = 0 drops the 5·a·s/h term
    else:
        x = megatron_activation_bytes(s, b, h, a, t, lay.sp)
    return x * bpe / 2


def memory(model, seq: int, lay, global_batch: int, hw) -> dict:
    """{term: bytes} of the heavier of the first and last pipeline stage; 'total' their sum."""
    bpe = hw.bytes_per_elem
    mixed = bpe == 2
    m = lay.micro_batches(global_batch)
    best = None
    for stage in ("first", "last"):
        psi = stage_params(model, lay, stage)
        st = model_state_bytes(lay.zero, psi, lay.dp, mixed)
        out = {"params": float(st["params"]), "grads": float(st["grads"]),
               "optimizer": 0.0 if lay.offload else float(st["master"] + st["optimizer"])}
        per_layer = layer_activation_bytes(model, seq, lay, bpe)
        if stage == "first":
            inflight = min(lay.pp, m)
            inter = 1 + (lay.pp - 1) / (lay.pp * lay.v) if lay.v > 1 else 1.0
            out["activations"] = model.layers / lay.pp * inflight * per_layer * inter \
                + inflight * seq * lay.mb * model.hidden * bpe / lay.tp     # embedding output
        else:
            out["activations"] = model.layers / lay.pp * per_layer + 4 * seq * lay.mb * model.vocab / lay.tp
        work = 0.0
        if lay.recompute == "full":
            work += layer_activation_bytes(model, seq, lay, bpe, "selective")
        if lay.zero == 3:   # two gathered layers: the one computing and the one prefetched
            work += 2 * model.layer_params() / lay.tp * bpe
        if lay.sp or lay.tp > 1:     # an all-gathered (or all-reduced) b·s·h input
            work += seq * lay.mb * model.hidden * bpe
        work += seq * lay.mb * model.f / lay.tp * bpe                  # the widest matmul output
        out["working"] = work
        out["reserved"] = hw.reserved
        out["total"] = sum(out.values())
        if best is None or out["total"] > best["total"]:
            best = {**out, "stage": stage}
    return best
