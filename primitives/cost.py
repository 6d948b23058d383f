"""The α-β(-γ) cost model: predicted time per algorithm, the exact traffic each rank sends,
and the choice algorithm="auto" makes.

    T(message of S bytes) = α + S·β          (α: latency, β: seconds per byte)
    reducing S bytes costs S·γ
    posting m messages at once costs α + (m-1)·o + (bytes)·β: they share one latency
    (o is the per-message software overhead; the "direct" algorithms rely on it being < α)

`traffic()` is the closed form each algorithm's docstring states: messages and bytes a given
rank sends. Tests compare it with what the ledger counted. `bench.py --fit` measures α and β
with a ping-pong; the defaults below were fitted on the 2-core development machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from primitives.algos import ALGORITHMS, PIPELINE_BYTES, chunk_bounds, segments


@dataclass(frozen=True)
class Params:
    alpha: float   # seconds per message: the latency of one dependent step
    beta: float    # seconds per byte on the wire
    gamma: float   # seconds per byte reduced
    o: float = 0.0 # seconds of sender-side overhead per extra message posted in the same round


# gloo: fitted by `torchrun --nproc_per_node 2|4 primitives/bench.py --fit` on the 2-core
# development machine (α ≈ 150–165 µs, β ≈ 0.27 ns/B ≈ 3.7 GB/s, γ ≈ 0.07–0.12 ns/B; tutorial 02).
# o = α: posting extra messages in one round was measured no cheaper than a dependent step
# here, so "direct" is never preferred over the ring by the model on this machine.
DEFAULTS = {
    "gloo": Params(alpha=1.5e-4, beta=2.7e-10, gamma=1.0e-10, o=1.5e-4),
    "mpi": Params(alpha=2.0e-5, beta=2.5e-10, gamma=2.5e-10, o=2.0e-5),
    "nccl": Params(alpha=1.0e-5, beta=1.0e-11, gamma=1.0e-12, o=1.0e-5),
}


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
    if name == "broadcast":
        return {"linear": (n - 1) * (a + S * b), "ring": (n - 2 + k) * (a + S * b / k),
                "tree": L * (a + S * b)}[algo]
    if name == "reduce":
        return {"linear": (n - 1) * (a + S * (b + g)), "ring": (n - 2 + k) * (a + S * (b + g) / k),
                "tree": L * (a + S * (b + g))}[algo]
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
    raise KeyError(name)


def choose(name: str, n: int, nbytes: int, backend: str = "gloo") -> str:
    """algorithm="auto": the algorithm with the lowest predicted time (ties: first listed)."""
    p = DEFAULTS.get(backend, DEFAULTS["gloo"])
    algos = [a for a in ALGORITHMS[name] if a != "linear" or n <= 2]
    return min(algos, key=lambda al: predict(name, al, n, nbytes, p))


def traffic(name: str, algo: str, n: int, rank: int, numel: int, elem: int, root: int = 0) -> tuple[int, int]:
    """(messages, bytes) that `rank` sends in one call, per the algorithm's docstring.

    numel is the caller's tensor (for reduce_scatter*: the output block; all_gather*: the
    input). Empty messages are never sent, so a zero-sized block costs no message.
    """
    S = numel * elem
    if n <= 1 or numel == 0:
        return 0, 0
    v = (rank - root) % n
    low = v & -v if v else 1 << n.bit_length()
    base = name.replace("_single", "")

    def kids(v):  # children of v in a binomial tree: v+1, v+2, v+4, … below lowbit(v)
        out, m = [], 1
        while m < low and v + m < n:
            out.append(m)
            m <<= 1
        return out

    def msgs(sizes):
        sizes = [s for s in sizes if s > 0]
        return len(sizes), sum(sizes)

    if base == "broadcast":
        if algo == "linear":
            return msgs([S] * (n - 1)) if v == 0 else (0, 0)
        if algo == "ring":
            return (segments(numel, elem), S) if v < n - 1 else (0, 0)
        return msgs([S] * len(kids(v)))
    if base == "reduce":
        if algo in ("linear", "tree"):
            return (0, 0) if v == 0 else (1, S)
        return (segments(numel, elem), S) if rank != root else (0, 0)
    if base == "all_reduce":
        P = 1 << (n.bit_length() - 1)
        rem = n - P
        if algo == "linear":
            return msgs([S] * (n - 1)) if rank == 0 else (1, S)
        if algo == "ring":
            c = [(e - s) * elem for s, e in chunk_bounds(numel, n)]
            return msgs([c[i] for i in range(n) if i != (rank + 1) % n] + [c[i] for i in range(n) if i != (rank + 2) % n])
        if algo == "direct":
            c = [(e - s) * elem for s, e in chunk_bounds(numel, n)]
            return msgs([c[i] for i in range(n) if i != rank] + [c[rank]] * (n - 1))
        if algo == "one_shot":
            return msgs([S] * (n - 1))
        if rank < 2 * rem and rank % 2 == 0:
            return 1, S
        fold = [S] if rank < 2 * rem else []
        nr = rank // 2 if rank < 2 * rem else rank - rem
        steps = int(math.log2(P))
        if algo == "recursive_doubling":
            return msgs([S] * steps + fold)
        c = [(e - s) * elem for s, e in chunk_bounds(numel, P)]
        halving = [_half_bytes(c, nr, P, i) for i in range(steps)]              # sums to S - c[nr]
        doubling = [sum(c[(nr & ~(m - 1)) + j] for j in range(m)) for m in (1 << i for i in range(steps))]
        return msgs(halving + doubling + fold)
    if base == "all_gather":
        if algo == "linear":
            return msgs([S] * (n - 1) ** 2) if rank == 0 else (1, S)
        return msgs([S] * (n - 1))                                              # ring and direct
    if base == "reduce_scatter":
        if algo == "linear":
            return msgs([S] * (n - 1)) if rank == 0 else (1, n * S)
        return msgs([S] * (n - 1))
    if base == "scatter":
        if algo == "linear":
            return msgs([S] * (n - 1)) if v == 0 else (0, 0)
        if algo == "ring":
            return msgs([S] * (n - 1 - v))
        size = lambda u: min(u & -u, n - u)  # noqa: E731
        return msgs([size(v + m) * S for m in _all_kids(v, n)])
    if base == "gather":
        if algo == "linear":
            return (0, 0) if v == 0 else (1, S)
        if algo == "ring":
            return (0, 0) if v == 0 else msgs([S] * (n - v))
        return (0, 0) if v == 0 else (1, min(low, n - v) * S)
    raise KeyError(name)


def _all_kids(v: int, n: int) -> list[int]:
    low = v & -v if v else 1 << n.bit_length()
    out, m = [], 1
    while m < low and v + m < n:
        out.append(m)
        m <<= 1
    return out


def _half_bytes(c, nr, P, i):
    """Bytes sent at halving step i (mask P>>(i+1)): the half of my current range I give away."""
    lo, hi, mask = 0, P, P >> 1
    for _ in range(i):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if not nr & mask else (mid, hi)
        mask >>= 1
    mid = (lo + hi) // 2
    give = (mid, hi) if not nr & mask else (lo, mid)
    return sum(c[give[0]:give[1]])
