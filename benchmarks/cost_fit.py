"""Fitting the cost model to measured times: α, β, γ, o per family (cost.family) and world size.

    python -m benchmarks.one_host            # measures, fits with this module, prints the errors

cost.predict is linear in (α, β, γ, o) for a given algorithm, N and S, so its four coefficients
are predict() evaluated at the unit vectors: the model's own formulas (the bytes traffic.py
counts), never restated here. The fit minimises Σ ((pred - t) / √(pred·t))², a relative error
that is symmetric (predicting 2× too slow costs what predicting 2× too fast does; plain
(pred - t)/t would favour predicting low), so a 4 KiB call weighs as much as a 64 MiB one, with
every constant ≥ 0: non-negative least squares by trying every subset of the four columns,
reweighted a few times (weights 1/√(pred·t) from the previous solve).
Cost: 15 tiny numpy solves per reweighting, microseconds.
"""
from __future__ import annotations

import itertools
import json

import numpy as np

from primitives.engine.cost import Params, family, predict

ROUNDS = 8   # reweightings: the constants settle to ~1e-3 within a handful here
UNITS = [Params(1, 0, 0, 0), Params(0, 1, 0, 0), Params(0, 0, 1, 0), Params(0, 0, 0, 1)]


def coefficients(name: str, algo: str, n: int, nbytes: int) -> list[float]:
    """[∂t/∂α, ∂t/∂β, ∂t/∂γ, ∂t/∂o] of cost.predict: t = their dot product with (α, β, γ, o)."""
    return [predict(name, algo, n, nbytes, u) for u in UNITS]


def nnls_relative(X: np.ndarray, t: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """argmin over x ≥ 0 of ‖(X x - t)·w‖₂ (w = 1/t unless given): the best unconstrained solve
    over every subset of columns whose solution is non-negative (an NNLS optimum is one of them)."""
    w = 1 / t if w is None else w
    A, y = X * w[:, None], t * w
    live = [j for j in range(X.shape[1]) if np.any(X[:, j])]
    best, best_res = np.zeros(X.shape[1]), float(np.sum(y ** 2))
    for k in range(1, len(live) + 1):
        for cols in itertools.combinations(live, k):
            x, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
            if np.all(x >= 0):
                res = float(np.sum((A[:, cols] @ x - y) ** 2))
                if res < best_res:
                    best_res, best = res, np.zeros(X.shape[1])
                    best[list(cols)] = x
    return best


def fit(points: list[tuple[str, str, int, int, float]]) -> Params:
    """points: (collective, algorithm, N, S, measured seconds), all of one family and one N."""
    X = np.array([coefficients(c, a, n, s) for c, a, n, s, _ in points], dtype=float)
    t = np.array([p[4] for p in points], dtype=float)
    x = nnls_relative(X, t)
    for _ in range(ROUNDS):
        pred = np.maximum(X @ x, t * 1e-3)
        x = nnls_relative(X, t, 1 / np.sqrt(pred * t))
    return Params(*(float(v) for v in x))


def fit_table(points: list[tuple[str, str, str, int, int, float]]) -> dict[str, dict[int, Params]]:
    """points: (transport, collective, algorithm, N, S, seconds) -> {family: {N: Params}}."""
    groups: dict = {}
    for tp, c, a, n, s, t in points:
        groups.setdefault((family(a, tp), n), []).append((c, a, n, s, t))
    out: dict = {}
    for (fam, n), pts in sorted(groups.items()):
        out.setdefault(fam, {})[n] = fit(pts)
    return out


def write_model(table: dict[str, dict[int, Params]], path: str, info: dict) -> None:
    """The JSON cost.load_model reads (RINGZERO_COST_MODEL)."""
    raw = {fam: {str(n): p.__dict__ for n, p in per_n.items()} for fam, per_n in table.items()}
    with open(path, "w") as f:
        json.dump(dict(info=info, params=raw), f, indent=1)


def as_python(table: dict[str, dict[int, Params]]) -> str:
    """The table as cost.FITTED's source text, to paste after a run on the reference machine."""
    lines = []
    for fam, per_n in table.items():
        cells = ", ".join(f"{n}: Params({p.alpha:.4g}, {p.beta:.4g}, {p.gamma:.4g}, {p.o:.4g})" for n, p in per_n.items())
        lines.append(f'    "{fam}": {{{cells}}},')
    return "\n".join(lines)
