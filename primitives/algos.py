"""The algorithm table and the chunking rules: a leaf module (imports nothing from primitives),
so the collectives (core.py) and the cost model (cost.py) both build on it without importing
each other.

    ALGORITHMS[collective] -> the algorithm names it accepts (besides "auto")
    chunk_bounds(numel, n) -> torch.tensor_split's chunk boundaries
    segments(numel, elem)  -> how many ~1 MiB segments a chain algorithm pipelines
    group_rank(comm, r)    -> a global rank's index in the communicator's group
"""
from __future__ import annotations

ALGORITHMS = {
    "broadcast": ["linear", "ring", "tree"],
    "reduce": ["linear", "ring", "tree"],
    "all_reduce": ["linear", "ring", "direct", "one_shot", "recursive_doubling", "rabenseifner", "hierarchical"],
    "all_gather": ["linear", "ring", "direct", "hierarchical"],
    "all_gather_single": ["linear", "ring", "direct", "hierarchical"],
    "scatter": ["linear", "ring", "tree"],
    "gather": ["linear", "ring", "tree"],
    "reduce_scatter": ["linear", "ring", "direct", "hierarchical"],
    "reduce_scatter_single": ["linear", "ring", "direct", "hierarchical"],
    "all_to_all": ["linear", "pairwise"],
    "all_to_all_single": ["linear", "pairwise"],
}

PIPELINE_BYTES = 1 << 20   # chain algorithms send in segments of about this size

# The checked default path (core.py): every call opens with one all-to-all round of fixed-size
# envelopes, HEADER_BYTES of call fingerprint + up to ENVELOPE_PAYLOAD bytes of data. Small calls
# ride inside it (no separate check round); the size is fixed so a mismatched call can never
# post a message of the wrong size.
HEADER_BYTES = 128
ENVELOPE_PAYLOAD = 64 << 10
ENVELOPE_BYTES = HEADER_BYTES + ENVELOPE_PAYLOAD


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """torch.tensor_split's rule: the first numel % n chunks get one extra element."""
    q, r = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        out.append((start, start + size))
        start += size
    return out


def segments(numel: int, elem_size: int) -> int:
    """k = ceil(S / 1 MiB) segments (at least 1, at most one per element)."""
    return max(1, min(numel, -(-numel * elem_size // PIPELINE_BYTES)))


def group_rank(comm, global_rank: int) -> int:
    """The index of `global_rank` in comm's group (identity for the default group and MPI)."""
    grp = getattr(comm, "group", None)
    if grp is None:
        return global_rank
    import torch.distributed as dist
    return dist.get_group_rank(grp, global_rank)
