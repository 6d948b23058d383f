"""The α-β(-γ) cost model: predicted time per algorithm, the exact traffic each rank sends,
and the choice algorithm="auto" makes.

    T(message of S bytes) = α + S·β          (α: latency, β: seconds per byte)
    reducing S bytes costs S·γ
    posting m messages at once costs α + (m-1)·o + (bytes)·β: they share one latency
    (o is the per-message software overhead; the "direct" algorithms rely on it being < α)

The bytes each algorithm sends are counted exactly in traffic.py. `bench.py --fit` measures α
and β with a ping-pong; the defaults below were fitted on the 2-core development machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from primitives.engine.algos import ALGORITHMS
from primitives.engine.shm_collectives import ONE_SHOT_BYTES
from primitives.engine.shm_segment import WS_BYTES
from primitives.engine.traffic import link_traffic, peers, traffic  # noqa: F401  (callers read them here too)
from primitives.ops import PIPELINE_BYTES


@dataclass(frozen=True)
class Params:
    alpha: float   # seconds per message: the latency of one dependent step
    beta: float    # seconds per byte on the wire
    gamma: float   # seconds per byte reduced
    o: float = 0.0 # seconds of sender-side overhead per extra message posted in the same round


# gloo: fitted by `torchrun --nproc_per_node 2|4 primitives/engine/bench.py --fit` on the 2-core
# development machine (α ≈ 150–165 µs, β ≈ 0.27 ns/B ≈ 3.7 GB/s, γ ≈ 0.07–0.12 ns/B; tutorial 02).
# o = α: posting extra messages in one round was measured no cheaper than a dependent step
# here, so "direct" is never preferred over the ring by the model on this machine.
DEFAULTS = {
    "gloo": Params(alpha=1.5e-4, beta=2.7e-10, gamma=1.0e-10, o=1.5e-4),
    "mpi": Params(alpha=2.0e-5, beta=2.5e-10, gamma=2.5e-10, o=2.0e-5),
    "nccl": Params(alpha=1.0e-5, beta=1.0e-11, gamma=1.0e-12, o=1.0e-5),
    # shared memory (primitives/engine/shm.py): ping-pong fitted by `mpiexec -n 2 python benchmarks/transports.py
    # --fit` on the 2-core machine while it was shared (load ~25): α ≈ 0.6 ms (gloo in the same run
    # also ≈ 0.6 ms), β ≈ 1.3 ns/B (gloo 1.4). On an idle machine both α are far smaller; only the
    # ratios between algorithms on this transport matter for auto.
    "shm": Params(alpha=6.0e-4, beta=1.3e-9, gamma=1.0e-10, o=6.0e-4),
}
SHM_NATIVE = ("all_reduce", "all_gather", "all_gather_single", "reduce_scatter", "reduce_scatter_single")


def ring_fraction(collective: str, n: int) -> Fraction:
    """The share of the full buffer S one rank sends in a ring: 2(N-1)/N for all-reduce,
    (N-1)/N for reduce-scatter and all-gather. THE byte formula: ledgers and chapters use it."""
    if n <= 1:
        return Fraction(0)
    base = collective.replace("_single", "")
    if base == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if base in ("reduce_scatter", "all_gather"):
        return Fraction(n - 1, n)
    raise KeyError(f"no ring formula for {collective!r}")


def ring_bytes(collective: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring for a full buffer of nbytes (rounded down); broadcast:
    each non-last rank of the chain forwards the buffer once."""
    if n <= 1:
        return 0
    if collective == "broadcast":
        return nbytes
    return int(ring_fraction(collective, n) * nbytes)


def _log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def predict(name: str, algo: str, n: int, nbytes: int, p: Params) -> float:
    """Predicted seconds for one call. nbytes = S, the full buffer as nccl-tests counts it
    (for all-gather the output, for reduce-scatter the input, for scatter/gather all N blocks)."""
    a, b, g, o, S = p.alpha, p.beta, p.gamma, p.o, nbytes
    if n <= 1:
        return 0.0
    L = _log2(n)
    P = 1 << (n.bit_length() - 1)
    fold = 2 * (a + S * b) + S * g if P != n else 0.0
    k = max(1, math.ceil(S / PIPELINE_BYTES))
    if algo == "shm":     # shm_collectives: rounds of one workspace, 1-2 barriers (α) each. A message
        c = b / 2         # is copied twice (into a slot, out of it): β; the workspace once, peers read it in place: c = β/2 a byte
        if name == "all_reduce" and S <= ONE_SHOT_BYTES:
            return a + S * c + (n - 1) * S * g
        if name == "all_reduce":
            rounds = max(1, math.ceil(S / WS_BYTES))
            return 2 * rounds * a + (2 * n - 1) / n * S * c + (n - 1) / n * S * g
        s = S / n
        rounds = max(1, math.ceil(s * (1 if name.startswith("all_gather") else n) / WS_BYTES))
        if name.startswith("all_gather"):
            return rounds * a + n * s * c
        return rounds * a + n * s * c + (n - 1) * s * g
    if name == "broadcast":
        return {"linear": (n - 1) * (a + S * b), "ring": (n - 2 + k) * (a + S * b / k),
                "tree": L * (a + S * b)}[algo]
    if name == "reduce":
        return {"linear": (n - 1) * (a + S * (b + g)), "ring": (n - 2 + k) * (a + S * (b + g) / k),
                "tree": L * (a + S * (b + g))}[algo]
    if algo == "hierarchical":     # one link class means one node: the hierarchy is the plain ring
        algo = "ring"
    if name == "all_reduce":
        lp = int(math.log2(P))
        return {"linear": 2 * (n - 1) * (a + S * b) + (n - 1) * S * g,
                "ring": 2 * (n - 1) * a + 2 * (n - 1) / n * S * b + (n - 1) / n * S * g,
                "direct": 2 * a + 2 * (n - 2) * o + 2 * (n - 1) / n * S * b + (n - 1) / n * S * g,
                "one_shot": a + (n - 2) * o + (n - 1) * S * (b + g),
                "recursive_doubling": lp * (a + S * (b + g)) + fold,
                "rabenseifner": 2 * lp * a + 2 * (P - 1) / P * S * b + (P - 1) / P * S * g + fold}[algo]
    s = S / n
    if name in ("all_gather", "all_gather_single"):
        return {"linear": (n - 1) * (a + s * b) + (n - 1) ** 2 * (a + s * b), "ring": (n - 1) * (a + s * b),
                "direct": a + (n - 2) * o + (n - 1) * s * b}[algo]
    if name in ("reduce_scatter", "reduce_scatter_single"):
        return {"linear": (n - 1) * (a + S * (b + g)) + (n - 1) * (a + s * b),
                "ring": (n - 1) * (a + s * (b + g)),
                "direct": a + (n - 2) * o + (n - 1) * s * (b + g)}[algo]
    if name in ("scatter", "gather"):
        return {"linear": (n - 1) * (a + s * b), "ring": (n - 1) * (a + s * b) + (n - 2) * a,
                "tree": L * a + (n - 1) * s * b}[algo]
    if name in ("all_to_all", "all_to_all_single"):      # S = this rank's whole input
        return {"linear": a + (n - 2) * o + (n - 1) * s * b, "pairwise": (n - 1) * (a + s * b)}[algo]
    raise KeyError(name)


def choose(name: str, n: int, nbytes: int, backend: str = "gloo", transport: str | None = None) -> str:
    """algorithm="auto": the algorithm with the lowest predicted time (ties: first listed).
    On the shared-memory transport its own fitted parameters, and the "shm" algorithms too."""
    p = DEFAULTS["shm"] if transport in ("shm", "shm+tcp") else DEFAULTS.get(backend, DEFAULTS["gloo"])
    # "hierarchical" only pays with more than one node: core.resolve asks primitives.engine.topology first;
    # "linear" is the naive through-one-rank algorithm, except for all-to-all (post everything at once)
    algos = [a for a in ALGORITHMS[name]
             if (a != "linear" or n <= 2 or name.startswith("all_to_all")) and a != "hierarchical"]
    algos = (["shm"] if transport == "shm" and name in SHM_NATIVE else []) + algos   # ties: shm (no messages)
    return min(algos, key=lambda al: round(predict(name, al, n, nbytes, p), 9))   # ns: ties are ties


# ----------------------------------------------------------------------------- two link classes
# multinode: m nodes × k ranks, ranks numbered node by node (how torchrun, deepspeed and mpiexec
# place them). "intra" = between ranks of one node (loopback here), "inter" = across the NIC.

@dataclass(frozen=True)
class Links:
    intra: Params
    inter: Params


def predict_2level(name: str, algo: str, m: int, k: int, nbytes: int, links: Links) -> float:
    """Predicted seconds on m nodes × k ranks. algo: "ring" (flat, what a topology-blind ring does,
    also our model of gloo's built-in), or "hierarchical". S = nbytes as in predict().

    Flat ring: every step has one inter-node hop per node and waits for it, so each of its
    2(N-1) steps costs α_e + S/N·β_e. Hierarchical: the k ranks of a node send their inter-node
    shares at the same time through one NIC, so a step of the inter ring costs α_e + k·(S/k)/m·β_e.
    """
    a, e, S, n = links.intra, links.inter, nbytes, m * k
    if n <= 1:
        return 0.0
    s = S / n
    if name == "all_reduce":
        if algo == "ring":
            return 2 * (n - 1) * (e.alpha + s * e.beta) + (n - 1) * s * e.gamma
        return (2 * (k - 1) * (a.alpha + S / k * a.beta) + (k - 1) / k * S * a.gamma
                + 2 * (m - 1) * (e.alpha + S / m * e.beta) + (m - 1) / m * S / k * e.gamma)
    if name.startswith("all_gather"):
        if algo == "ring":
            return (n - 1) * (e.alpha + s * e.beta)
        return (m - 1) * (e.alpha + k * s * e.beta) + m * (k - 1) * (a.alpha + s * a.beta)
    if name.startswith("reduce_scatter"):
        if algo == "ring":
            return (n - 1) * (e.alpha + s * (e.beta + e.gamma))
        return m * (k - 1) * (a.alpha + s * (a.beta + a.gamma)) + (m - 1) * (e.alpha + k * s * e.beta + s * e.gamma)
    raise KeyError(name)
