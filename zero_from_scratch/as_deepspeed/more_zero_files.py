"""deepspeed.utils.zero_to_fp32's file listing helpers: a checkpoint folder's rank files in human order.

    from deepspeed.utils.zero_to_fp32 import get_optim_files     (under the runner)
    get_optim_files("ckpt/global_step10")   # [..zero_pp_rank_0_.._optim_states.pt, ..rank_1.., ..rank_10..]

DeepSpeed's own (utils/zero_to_fp32.py): a glob sorted with numbers compared as numbers, so rank
10 follows rank 9; none found is FileNotFoundError. Cost: one directory listing.
"""
from __future__ import annotations

import glob
import os
import re


def natural_keys(text: str) -> list:
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir, glob_pattern: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=natural_keys)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")
