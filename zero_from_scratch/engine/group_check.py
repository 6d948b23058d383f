"""zero.Init's guard: a launcher world of N > 1 ranks, but Init resolved a group of one rank.

    Init()   # WORLD_SIZE=8 from the launcher, yet no group or a size-1 group → RuntimeError

A library that starts torch.distributed with a world of one before the script's own
init_distributed (transformers' from_pretrained, for one) leaves every rank building the whole
model: nothing would be partitioned, and the failure looks like an out-of-memory. DeepSpeed
0.19.8 raises instead, whether or not Init is `enabled` (runtime/zero/partition_parameters.py,
`_contradicting_single_rank_pg_error`, called in Init.__init__): contradicting_single_rank_pg_error
is that rule in DeepSpeed's words (served to the runner's Init). ringzero's own Init does not start
torch.distributed itself, so it also fires when nobody has started it (a world of one); its message,
refuse_single_rank_group's, names ringzero's entry point, primitives.launch.init_from_env().
A group the caller passes (data_parallel_group, or the deprecated sequence_data_parallel_group)
is taken as intended. Cost: one environment read.
"""
from __future__ import annotations

import os

import torch.distributed as dist


def _launcher_world_size(env) -> int:
    try:
        return int(env.get("WORLD_SIZE", "0") or "0")
    except (TypeError, ValueError):                 # an unreadable WORLD_SIZE is no evidence either way
        return 0


def contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None) -> str | None:
    """DeepSpeed's message when the launcher says WORLD_SIZE > 1 but Init's default group has one rank, else None."""
    env = os.environ if env is None else env
    if dp_world_size != 1 or explicit_process_group is not None or (n := _launcher_world_size(env)) <= 1:
        return None
    return ("zero.Init resolved a process group of world_size=1, but the launcher environment reports "
            f"WORLD_SIZE={n}. A single-rank process group was likely initialized before zero.Init "
            "ran (for example, `from_pretrained` executed before `deepspeed.init_distributed()`). Parameters would NOT "
            "be partitioned: every rank would allocate the full model and likely OOM. Call "
            "`deepspeed.init_distributed()` before constructing the model under zero.Init, or pass an explicit "
            "`data_parallel_group` if a single-rank group is intentional.")


def refuse_single_rank_group(group, env=None) -> None:
    """ringzero's Init: RuntimeError when `group` (None: the world; no torch.distributed: a world of one)
    contradicts the launcher's WORLD_SIZE > 1."""
    env = os.environ if env is None else env
    started = dist.is_initialized()
    if contradicting_single_rank_pg_error(dist.get_world_size(group) if started else 1, group, env) is None:
        return
    why = ("a process group of one rank was started before zero.Init (for example by a library's from_pretrained)"
           if started else "torch.distributed is not initialized, so zero.Init sees a world of one rank")
    raise RuntimeError(f"zero.Init: the launcher environment reports WORLD_SIZE={_launcher_world_size(env)}, but {why}. "
                       "Parameters would NOT be partitioned: every rank would hold the whole model. Call "
                       "`primitives.launch.init_from_env()` before constructing the model under zero.Init, or pass "
                       "an explicit `data_parallel_group` if a single-rank group is intentional.")


def refuse_as_deepspeed(group) -> None:
    """The runner's Init (torch.distributed already started, as DeepSpeed's Init starts it): DeepSpeed's message."""
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if (message := contradicting_single_rank_pg_error(n, group)) is not None:
        raise RuntimeError(message)
