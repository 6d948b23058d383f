"""What tensor parallelism should cost, in closed form: bytes on the wire per step (built on
primitives.engine.cost.traffic, the one home of per-collective byte formulas), parameters per rank,
and Megatron's activation memory per layer.

    python -m pytest -q tests/test_tensor_parallel_model.py -k ledger

Communication per transformer layer, forward + backward, activations of b·s·h elements
(Megatron-LM §3; Megatron-SP, Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2):
    plain TP   4 all-reduces of b·s·h          (g twice forward, f twice backward)
    SP         6 all-gathers + 4 reduce-scatters of b·s·h/N per rank: the 4 + 4 that replace the
               all-reduces (with ring algorithms exactly their bytes, since all-reduce =
               reduce-scatter + all-gather) and 2 more in backward, re-gathering the inputs of
               Q/K/V and lin1, which keep only their sequence shard for the weight gradient
               (Megatron-SP's layout; 1.25× plain TP's bytes)
plus, for the whole DistilBERT model: one all-reduce of b·s·h after the vocab-parallel
embedding; with SP also one all-gather entering (backward) and leaving (forward) the
sequence-parallel region and one all-reduce per SP parameter gradient (6 vectors of h per layer).

Activation memory per layer (Megatron-SP, eq. 1-5; 16-bit activations, 1-byte dropout masks):
    no parallelism   s·b·h·(34 + 5·a·s/h)
    tensor parallel  s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP + SP          s·b·h·(34 + 5·a·s/h) / t
"""
from __future__ import annotations

from primitives.engine.cost import traffic
from tensor_parallel.layers import shard_bounds


def layer_traffic(b: int, s: int, h: int, tp: int, rank: int, sequence_parallel: bool,
                  algorithm: str = "ring", elem: int = 4) -> tuple[dict, int]:
    """({collective: calls}, bytes `rank` sends) for one layer's forward + backward."""
    if tp == 1:
        return {}, 0
    if not sequence_parallel:
        return {"all_reduce": 4}, 4 * traffic("all_reduce", algorithm, tp, rank, b * s * h, elem)[1]
    block = b * s * h // tp                # each rank's slice of the sequence
    ag = traffic("all_gather_single", algorithm, tp, rank, block, elem)[1]
    rs = traffic("reduce_scatter_single", algorithm, tp, rank, block, elem)[1]
    return {"all_gather_single": 6, "reduce_scatter_single": 4}, 6 * ag + 4 * rs


def distilbert_traffic(cfg, b: int, s: int, tp: int, rank: int, sequence_parallel: bool,
                       algorithm: str = "ring", elem: int = 4) -> tuple[dict, int]:
    """({collective: calls}, bytes sent) for one forward + backward of a parallelized DistilBERT."""
    h, L = cfg.dim, cfg.n_layers
    calls, nbytes = layer_traffic(b, s, h, tp, rank, sequence_parallel, algorithm, elem)
    calls = {k: v * L for k, v in calls.items()}
    nbytes *= L
    if tp == 1:
        return calls, nbytes
    ar = lambda numel: traffic("all_reduce", algorithm, tp, rank, numel, elem)[1]  # noqa: E731
    calls["all_reduce"] = calls.get("all_reduce", 0) + 1        # the vocab-parallel embedding's g
    nbytes += ar(b * s * h)
    if sequence_parallel:
        calls["all_gather_single"] += 2                          # split (backward) + gather (forward)
        nbytes += 2 * traffic("all_gather_single", algorithm, tp, rank, b * s * h // tp, elem)[1]
        calls["all_reduce"] += 6 * L                             # SP parameter gradients
        nbytes += 6 * L * ar(h)
    return calls, nbytes


def distilbert_params(cfg, tp: int, rank: int) -> int:
    """Parameters rank holds after parallelize(): sharded parts by shard_bounds, the rest whole."""
    h, f, v, L = cfg.dim, cfg.hidden_dim, cfg.vocab_size, cfg.n_layers
    hd = h // cfg.n_heads
    width = lambda lo_hi: lo_hi[1] - lo_hi[0]  # noqa: E731
    hr, fr, vr = width(shard_bounds(h, tp, rank, hd)), width(shard_bounds(f, tp, rank)), width(shard_bounds(v, tp, rank))
    emb = vr * h + cfg.max_position_embeddings * h + 2 * h
    layer = 3 * (hr * h + hr) + (h * hr + h) + 2 * h + (fr * h + fr) + (h * fr + h) + 2 * h
    head = h * h + h + h * cfg.num_labels + cfg.num_labels
    return int(emb + L * layer + head)


def megatron_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Megatron-SP's activation bytes per transformer layer (16-bit activations, with dropout)."""
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
