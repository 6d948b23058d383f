"""The one process-wide setting the engine makes: large host blocks are mapped, not heap.

    RINGZERO_MALLOC=default python train.py        # leave glibc's allocator exactly as it is

glibc serves a block below its mmap threshold from a heap that returns memory to the system only
from its top; the threshold starts at 128 KiB and rises (up to 32 MiB) each time a mapped block
is freed, so after the first freed unit every unit-sized block comes from that heap, and the heap
keeps the high-water mark of everything that was ever free at once between long-lived small
blocks. The engine's per-step buffers come from pools (pools.py) and are not freed; what is still
allocated and freed per step or while the model is built and adopted (a module's weights under
zero.Init, a unit assembled at initialize, autograd's gradients and activations) is returned at
once only if it is mapped. So at ZeRO-3 start-up and on entering zero.Init the engine fixes
M_MMAP_THRESHOLD at THRESHOLD (1 MiB; fixing it also stops the rise), says so on rank 0, once, and
RINGZERO_MALLOC=default switches it off. Cost: a page fault per 4 KiB of each mapped block
(≈ 0.1 ms per MiB), only for blocks ≥ 1 MiB.
"""
from __future__ import annotations

import ctypes
import os

from primitives.log import print0

ENV = "RINGZERO_MALLOC"
THRESHOLD = 1 << 20
M_MMAP_THRESHOLD = -3             # glibc's mallopt parameter number
_set = False


def map_large_blocks() -> bool:
    """Fix glibc's mmap threshold at THRESHOLD (once per process) unless RINGZERO_MALLOC=default;
    True when it is set."""
    global _set
    if _set or os.environ.get(ENV, "").lower() == "default":
        return _set
    try:
        ok = ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    if ok:
        _set = True
        print0(f"[zero_from_scratch] process-wide: glibc M_MMAP_THRESHOLD = {THRESHOLD >> 20} MiB (blocks of ≥ 1 MiB "
               f"are mapped and return to the system when freed); {ENV}=default leaves the allocator alone",
               soft_wrap=True)
    return _set
