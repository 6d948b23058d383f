"""The algorithm table and the check round's sizes: a leaf module, so the checked call (core.py)
and the cost model (cost.py) both build on it without importing each other.

    ALGORITHMS[collective] -> the algorithm names it accepts (besides "auto"): the functions of
                              primitives/<collective>.py, plus "hierarchical" (subcomm.py)
    group_rank(comm, r)    -> a global rank's index in the communicator's group
"""
from __future__ import annotations

import torch.distributed as dist

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

# The checked default path (core.py): every call opens with one all-to-all round of fixed-size
# envelopes, HEADER_BYTES of call fingerprint + up to ENVELOPE_PAYLOAD bytes of data. Small calls
# ride inside it (no separate check round); the size is fixed so a mismatched call can never
# post a message of the wrong size.
HEADER_BYTES = 128
ENVELOPE_PAYLOAD = 64 << 10
ENVELOPE_BYTES = HEADER_BYTES + ENVELOPE_PAYLOAD


def group_rank(comm, global_rank: int) -> int:
    """The index of `global_rank` in comm's group (identity for the default group and MPI)."""
    grp = getattr(comm, "group", None)
    if grp is None:
        return global_rank
    return dist.get_group_rank(grp, global_rank)
