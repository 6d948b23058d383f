"""ZeRO-3's gathered units allocated per gather, as DeepSpeed allocates them (the runner's choice).

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json      (stage 3)

ringzero's stage 3 takes each gathered unit's buffer from a pool (pools.py) and gives it back at
release, so the next gather of that size reuses the same storage when nothing else still sees it.
DeepSpeed allocates a new buffer at every all-gather and frees it at release (the allocator may
hand the memory back, but it is a new storage): a script may tell a gather from the last one by
its storage, as DeepSpeed's own tests do (the weight its ZeRO-3 Linear saved comes back in backward
in a storage other than forward's). Under the runner the stage does the same (`allocate_per_gather`).
Cost: an allocation per gather and the glibc heap behaviour pools.py avoids; bytes moved unchanged.
"""
from __future__ import annotations

import torch

from zero_from_scratch.engine.pools import Pool


class PerGather(Pool):
    """A pool that keeps nothing: a buffer given back is freed when its last user drops it."""

    def give(self, t: torch.Tensor) -> None:
        if self.own.pop(id(t), None) is not None:
            self.in_use -= t.numel() * self.b
            self.held -= t.numel() * self.b


def allocate_per_gather(stage) -> None:
    """stage (engine/stage3.py's ZeroStage3) allocates each unit's buffer when it gathers it. The
    buffers out of the stage's pool (units gathered at initialize: persistent ones) stay counted."""
    old = stage.units_pool
    old.clear()                                   # its idle buffers go; those in use move over
    new = PerGather("gathered units (per gather)", stage.dtype, stage.dev)
    vars(new).update({k: v for k, v in vars(old).items() if k != "name"})     # every count and held buffer
    stage.units_pool = new
