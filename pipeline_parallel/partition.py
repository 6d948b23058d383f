"""Which layers go to which pipeline stage: pure functions, run once at construction on every rank.

    python -c "from pipeline_parallel.partition import balanced; print(balanced([1, 8, 8, 8, 1], 2))"

A partition is a list of boundaries `parts`, num_parts + 1 long: stage s owns layers parts[s] …
parts[s+1]−1 (DeepSpeed's `PipelineModule.parts`). uniform(n, k): equal layer counts, the first
n mod k stages one more. balanced(w, k): contiguous parts with a small spread max − min of the
stage weights. Both give DeepSpeed's boundaries (tests/test_pipeline_units.py compares them).
"""
from __future__ import annotations


def uniform(num_items: int, num_parts: int) -> list[int]:
    if num_parts < 1:
        raise ValueError(f"number of stages must be >= 1, got {num_parts}")
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for s in range(num_parts):
        parts.append(parts[-1] + base + (1 if s < extra else 0))
    return parts


def balanced(weights: list[int], num_parts: int) -> list[int]:
    """Contiguous non-empty parts with a small spread between the heaviest and lightest stage.

    The rule DeepSpeed's partition_balanced applies (so the same layers give the same split):
    a DP over (first i layers, j parts) that keeps, for each cell, the last cut k whose
    running (max − min) is smallest, where max/min are of the parts chosen so far. It is a
    greedy DP, not an exact optimiser of max − min, and not the min-max split either.
    """
    n = len(weights)
    if n <= num_parts:
        return uniform(n, num_parts)          # PipelineModule reports the empty stages
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = float("inf")
    hi = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    lo = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    cost = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    cut = [[0] * (num_parts + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                part = pre[i] - pre[k]
                h, l = max(hi[k][j - 1], part), min(lo[k][j - 1], part)
                if cost[i][j] >= h - l:        # ">=": ties go to the last cut, as DeepSpeed's
                    cost[i][j], hi[i][j], lo[i][j], cut[i][j] = h - l, h, l, k
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]
