"""The one process-wide setting the engine makes: large host blocks are mapped, not heap.

    RINGZERO_MALLOC=default python train.py        # leave glibc's allocator exactly as it is
    RINGZERO_MALLOC=1048576 python train.py        # another threshold, in bytes

glibc serves a block below its mmap threshold from a heap that returns memory to the system only
from its top; the threshold starts at 128 KiB and rises (up to 32 MiB) each time a mapped block
is freed, so after the first freed unit every unit-sized block comes from that heap, and the heap
keeps every hole left between long-lived small blocks: measured on a T5 (d_model 384) at ZeRO-3
with both offloads, 60-100 MiB per rank after zero.Init and initialize, and it kept growing step
after step. The engine's per-step buffers come from pools (pools.py) and are not freed; what is still
allocated and freed per step or while the model is built and adopted (a module's weights under
zero.Init, a unit assembled at initialize, autograd's gradients and activations) is returned at
once only if it is mapped. So at ZeRO-3 start-up and on entering zero.Init the engine fixes
M_MMAP_THRESHOLD at THRESHOLD (64 KiB: a transformer's activations of a small batch, a 384 × 384
projection and its shards are above it; fixing it also stops the rise) and the trim threshold at
glibc's initial 128 KiB (the rise had raised it too), says so on rank 0, once, and
RINGZERO_MALLOC=default switches it off. With it on, the engine also (release_freed) returns the
heap's free pages once ZeRO-3 has sharded a model built before the setting (its full tensors came
partly from the heap, and their holes would be reused and stay resident: measured 40 MiB per rank
on the T5 with both offloads) and after each optimizer step, and frees the buffers a phase leaves
idle (the backward's buckets, the step's staging: maps()). Cost: an mmap/munmap pair and a page
fault per 4 KiB for each block ≥ 64 KiB, i.e. per activation and autograd gradient of that size:
2-4 ms more per 4 MiB block than a reused heap block on this machine's 2 shared cores, a few % of
a ZeRO-3 step; malloc_trim walks the free lists once per step.
"""
from __future__ import annotations

import ctypes
import os

from primitives.log import print0

ENV = "RINGZERO_MALLOC"
THRESHOLD = 64 << 10
M_MMAP_THRESHOLD = -3             # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD = -1
TRIM = 128 << 10                  # glibc's initial trim threshold, which its dynamic threshold raises
_set = False


def map_large_blocks() -> bool:
    """Fix glibc's mmap threshold at THRESHOLD (once per process) unless RINGZERO_MALLOC=default;
    True when it is set."""
    global _set
    env = os.environ.get(ENV, "").lower()
    if _set or env == "default":
        return _set
    size = int(env) if env.isdigit() else THRESHOLD
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, size) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM) == 1
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    if ok:
        _set = True
        print0(f"\\[zero_from_scratch] process-wide: glibc M_MMAP_THRESHOLD = {size >> 10} KiB (blocks of ≥ {size >> 10} KiB "
               f"are mapped and return to the system when freed); {ENV}=default leaves the allocator alone",
               soft_wrap=True)
    return _set


def maps() -> bool:
    """True when map_large_blocks set the threshold: a freed large block returns to the system at
    once, so a buffer idle for a whole phase is better freed than kept."""
    return _set


def release_freed() -> bool:
    """Return the heap's free pages to the system (glibc malloc_trim(0)), once the engine has
    dropped what it no longer needs (a model's full tensors after ZeRO-3 sharded them): they were
    allocated before the threshold was fixed, many from the heap, and their holes would otherwise
    stay resident. Only when map_large_blocks set the threshold (RINGZERO_MALLOC=default: nothing)."""
    if not _set:
        return False
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim(0) == 1
    except (OSError, AttributeError):
        return False
