"""The real DeepSpeed, imported quietly, for code that runs it beside this engine (an application's
`--engine deepspeed`, the parity harnesses, the clients), and a process's peak memory.

    python -c "from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed; prepare_deepspeed()"

deepspeed.comm's TorchBackend JIT-builds `deepspeed_shm_comm` (~1 min on 2 busy cores, then cached
in TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) on its first use on CPU. That op only
backs `inference_all_reduce`; training collectives go to torch.distributed (gloo). Marking it
incompatible makes build_shm_op() return None: no build, same numerics. Cost: deepspeed's import.
"""
from __future__ import annotations

import logging
import os

import torch

SHM_OP = "deepspeed_shm_comm"


def prepare_deepspeed(skip_shm_build: bool = True):
    """Import deepspeed quietly; by default mark its shared-memory comm op as incompatible."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # before import: it logs at import
    import deepspeed  # optional dependency
    import deepspeed.ops  # optional dependency
    deepspeed.utils.logger.setLevel(logging.ERROR)
    if skip_shm_build:
        skip_shm_op_build()
    return deepspeed


def skip_shm_op_build() -> None:
    """Mark DeepSpeed's `deepspeed_shm_comm` op incompatible, so it is never JIT-built."""
    import deepspeed.ops  # optional dependency
    deepspeed.ops.__compatible_ops__[SHM_OP] = False  # lazy dict: probe first, then override


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1
