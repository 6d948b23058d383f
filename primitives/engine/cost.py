"""The α-β(-γ) cost model: predicted time per algorithm, the exact traffic each rank sends,
and the choice algorithm="auto" makes.

    T(message of S bytes) = α + S·β          (α: latency, β: seconds per byte)
    reducing S bytes costs S·γ
    posting m messages at once costs α + (m-1)·o + (bytes)·β: they share one latency
    (o is the per-message software overhead; the "direct" algorithms rely on it being < α)

The bytes each algorithm sends are counted exactly in traffic.py. The constants are fitted by
least squares to the measured times of the algorithms themselves (benchmarks/cost_fit.py), per transport and
world size: `python -m benchmarks.one_host` measures, fits and prints the fit's error per size;
FITTED below holds its output on the 2-core development machine. `--write-model F` writes the
same table as JSON; RINGZERO_COST_MODEL=F makes `auto` read F instead (a missing or malformed F
is an error at the first choice, naming the file).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from fractions import Fraction

from primitives.engine.algos import ALGORITHMS
from primitives.engine.traffic import link_traffic, peers, traffic  # noqa: F401  (callers read them here too)
from primitives.ops import PIPELINE_BYTES


@dataclass(frozen=True)
class Params:
    alpha: float   # seconds per message: the latency of one dependent step
    beta: float    # seconds per byte on the wire
    gamma: float   # seconds per byte reduced
    o: float = 0.0 # seconds of sender-side overhead per extra message posted in the same round


# Fallbacks for backends one host cannot measure here (nccl) or that the benchmark does not fit
# (our algorithms over MPI): a ping-pong's α, β and a torch add's γ on the development machine.
DEFAULTS = {
    "mpi": Params(alpha=2.0e-5, beta=2.5e-10, gamma=2.5e-10, o=2.0e-5),
    "nccl": Params(alpha=1.0e-5, beta=1.0e-11, gamma=1.0e-12, o=1.0e-5),
}
# family -> {world size N -> Params}, fitted by `python -m benchmarks.one_host` (benchmarks/cost_fit.py) on
# the 2-core development machine. Families: "tcp" (the p2p algorithms over gloo's TCP), "shm" (the
# same algorithms over this host's shared-memory slots), "shm-native" (algorithm="shm": copies
# through a workspace and barriers, so its own α (a barrier) and β (a copy)). Per N, because
# with more ranks than cores a message's latency is a scheduler's time slice, not a wire's.
# Measured with the machine under a load of 18-33 (other jobs on its 2 cores): α is then a
# scheduler's time slice (ms), not a message's latency; refit on an idle machine and paste here.
FITTED: dict[str, dict[int, Params]] = {
    "shm": {2: Params(0.002953, 2.963e-09, 5.009e-09, 0), 4: Params(0.004958, 4.05e-09, 1.555e-09, 0.0004854)},
    "shm-native": {2: Params(0.002857, 3.613e-09, 8.306e-10, 0), 4: Params(0.005844, 3.653e-09, 0, 0)},
    "tcp": {2: Params(0.002463, 3.104e-09, 6.212e-09, 0), 4: Params(0.005759, 4.1e-09, 2.217e-09, 0.0002469)},
}
MODEL_ENV = "RINGZERO_COST_MODEL"
_LOADED: dict = {}


def family(algo: str, transport: str | None, backend: str = "gloo") -> str:
    """Which fitted table an algorithm's time comes from. shm+tcp: a flat algorithm waits for
    its slowest link, TCP."""
    if backend in DEFAULTS:
        return backend
    if transport == "shm":
        return "shm-native" if algo == "shm" else "shm"
    return "tcp"


def load_model(path: str) -> dict[str, dict[int, Params]]:
    """The JSON one_host.py --write-model writes: {"params": {family: {N: {alpha, beta, gamma, o}}}}."""
    try:
        with open(path) as f:
            raw = json.load(f)["params"]
        return {fam: {int(n): Params(**v) for n, v in per_n.items()} for fam, per_n in raw.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MODEL_ENV}={path}: cannot read a cost model from it ({e!r}); write one with "
                         f"`python -m benchmarks.one_host --write-model {path}` or unset {MODEL_ENV}") from None


def params(fam: str, n: int) -> Params:
    """The fitted constants of `fam` at world size n (the nearest fitted N when n was not
    measured; ties: the larger N, the more pessimistic latency)."""
    path = os.environ.get(MODEL_ENV)
    table = FITTED
    if path:
        if path not in _LOADED:
            _LOADED[path] = {**FITTED, **load_model(path)}
        table = _LOADED[path]
    if fam not in table:
        return DEFAULTS.get(fam, DEFAULTS["mpi"])
    per_n = table[fam]
    return per_n[min(per_n, key=lambda m: (abs(m - n), -m))]


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
    if algo == "shm":     # shm_collectives: copies through a workspace, a barrier (α) per phase. Per rank it
        s = S / n         # copies what "direct" sends (2(N-1)/N·S all-reduce) and reduces its slice, except
        if name == "all_reduce":   # a small all-reduce: one phase, all N buffers reduced (traffic.py: N-1 messages)
            if traffic("all_reduce", "shm", n, 0, S, 1)[0] == n - 1:
                return a + S * b + (n - 1) * S * g
            return 2 * a + 2 * (n - 1) * s * b + (n - 1) * s * g
        if name.startswith("all_gather"):
            return a + (n - 1) * s * b
        return a + (n - 1) * s * (b + g)
    if name == "broadcast":
        return {"linear": a + (n - 2) * o + (n - 1) * S * b, "ring": (n - 2 + k) * (a + S * b / k),
                "tree": L * (a + S * b)}[algo]
    if name == "reduce":
        return {"linear": a + (n - 2) * o + (n - 1) * S * (b + g), "ring": (n - 2 + k) * (a + S * (b + g) / k),
                "tree": L * (a + S * (b + g))}[algo]
    if algo == "hierarchical":     # one link class means one node: the hierarchy is the plain ring
        algo = "ring"
    if name == "all_reduce":
        lp = int(math.log2(P))
        # linear (every collective): the root posts its receives, then its sends, each phase at once
        return {"linear": 2 * a + 2 * (n - 2) * o + 2 * (n - 1) * S * b + (n - 1) * S * g,
                "ring": 2 * (n - 1) * a + 2 * (n - 1) / n * S * b + (n - 1) / n * S * g,
                "direct": 2 * a + 2 * (n - 2) * o + 2 * (n - 1) / n * S * b + (n - 1) / n * S * g,
                "one_shot": a + (n - 2) * o + (n - 1) * S * (b + g),
                "recursive_doubling": lp * (a + S * (b + g)) + fold,
                "rabenseifner": 2 * lp * a + 2 * (P - 1) / P * S * b + (P - 1) / P * S * g + fold}[algo]
    s = S / n
    if name in ("all_gather", "all_gather_single"):
        m = (n - 1) ** 2      # linear: N-1 blocks in to rank 0, then its (N-1)² sends, each phase posted at once
        return {"linear": 2 * a + (n - 2 + m - 1) * o + (n - 1 + m) * s * b, "ring": (n - 1) * (a + s * b),
                "direct": a + (n - 2) * o + (n - 1) * s * b}[algo]
    if name in ("reduce_scatter", "reduce_scatter_single"):
        return {"linear": 2 * a + 2 * (n - 2) * o + (n - 1) * S * (b + g) + (n - 1) * s * b,
                "ring": (n - 1) * (a + s * (b + g)),
                "direct": a + (n - 2) * o + (n - 1) * s * (b + g)}[algo]
    if name in ("scatter", "gather"):
        return {"linear": a + (n - 2) * o + (n - 1) * s * b, "ring": (n - 1) * (a + s * b) + (n - 2) * a,
                "tree": L * a + (n - 1) * s * b}[algo]
    if name in ("all_to_all", "all_to_all_single"):      # S = this rank's whole input
        return {"linear": a + (n - 2) * o + (n - 1) * s * b, "pairwise": (n - 1) * (a + s * b)}[algo]
    raise KeyError(name)


def choose(name: str, n: int, nbytes: int, backend: str = "gloo", transport: str | None = None) -> str:
    """algorithm="auto": the algorithm with the lowest predicted time (ties: first listed), each
    with its own family's fitted constants; on the shared-memory transport "shm" too."""
    # "hierarchical" only pays with more than one node: core.resolve asks primitives.engine.topology first;
    # "linear" is the naive through-one-rank algorithm, except for all-to-all (post everything at once)
    algos = [a for a in ALGORITHMS[name]
             if (a != "linear" or n <= 2 or name.startswith("all_to_all")) and a != "hierarchical"]
    algos = (["shm"] if transport == "shm" and name in SHM_NATIVE else []) + algos   # ties: shm (no messages)
    return min(algos, key=lambda al: round(predict(name, al, n, nbytes, params(family(al, transport, backend), n)), 9))


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
