"""zero.Init's guard: a launcher world of N > 1 ranks, but Init resolved a group of one rank.

    Init()   # WORLD_SIZE=8 from the launcher, yet a size-1 group was started first → RuntimeError

A library that starts torch.distributed with a world of one before the script's own
init_distributed (transformers' from_pretrained, for one) leaves every rank building the whole
model: nothing would be partitioned, and the failure looks like an out-of-memory. DeepSpeed
0.19.8 raises instead (runtime/zero/partition_parameters.py, `_contradicting_single_rank_pg_error`,
called in Init.__init__); this is the same rule and the same words. A group the caller passes
(data_parallel_group, or the deprecated sequence_data_parallel_group) is taken as intended.
Cost: one environment read.
"""
from __future__ import annotations

import os

import torch.distributed as dist


def contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None) -> str | None:
    """The error message when the launcher says WORLD_SIZE > 1 but Init's default group has one rank, else None
    (an unreadable WORLD_SIZE is no evidence either way: None)."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launcher_world_size = int(env.get("WORLD_SIZE", "0") or "0")
    except (TypeError, ValueError):
        return None
    if launcher_world_size <= 1:
        return None
    return ("zero.Init resolved a process group of world_size=1, but the launcher environment reports "
            f"WORLD_SIZE={launcher_world_size}. A single-rank process group was likely initialized before zero.Init "
            "ran (for example, `from_pretrained` executed before `deepspeed.init_distributed()`). Parameters would NOT "
            "be partitioned: every rank would allocate the full model and likely OOM. Call "
            "`deepspeed.init_distributed()` before constructing the model under zero.Init, or pass an explicit "
            "`data_parallel_group` if a single-rank group is intentional.")


def refuse_single_rank_group(group) -> None:
    """Init's call: raise RuntimeError(the message) when `group` (None: the world) contradicts the launcher."""
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if (message := contradicting_single_rank_pg_error(n, group)) is not None:
        raise RuntimeError(message)
