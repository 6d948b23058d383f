"""Fresh mappings, fitted for the planner: how many bytes a step maps afresh when glibc maps every
large block, and what a CPU second of mapping buys, each measured on its own (benchmarks.planner_fit).

    python -m benchmarks.planner_fit --engine       # refits these with the whole-step terms (~2 min idle)

With glibc's mmap threshold fixed at 64 KiB (zero_from_scratch's ZeRO-3 engine does it; the
"malloc 64K" row of benchmarks.planner_local asks for it) every block of 64 KiB or more a step
allocates is a fresh mapping, and each of its pages costs a page fault (the kernel zeroes it) and
its share of an mmap/munmap pair. The planner counts those bytes from what it already counts:

    map_layer   bytes first touched per byte a layer saves for backward (torch's encoder layer,
                forward + backward at the fit's layer shapes): its transient products (q, k, v,
                the scores' softmax, the FFN's input) and the backward's gradient of each
    map_head    bytes first touched per logit byte of the top (LayerNorm, logits, cross-entropy,
                forward + backward at the fit's head shapes): the logits, log-softmax, their
                gradients and the tied table's gradient product
    mmap_s      CPU seconds per byte first touched in a mapped block beyond the same work in a
                reused heap block: 1 MiB blocks written once each (`x + 1`), glibc's defaults (the
                block comes back from the heap) against the threshold fixed at 64 KiB

Bytes are counted by the thread's minor page faults (getrusage, 4 KiB pages: refused when
transparent huge pages are 'always'; not timed); only mmap_s is a timing. Cost: a few dozen layer
and head steps and 2 × 16 × reps block writes per process, ~15 s.
"""
from __future__ import annotations

import ctypes
import resource
import statistics

import torch

from benchmarks.planner_fit_loss import HEADS, cpu
from planner.layout import Layout
from planner.memory import torch_layer_activation_bytes
from planner.model import Model
from primitives.launch import spawn

M_MMAP_THRESHOLD, THRESHOLD = -3, 64 << 10        # as zero_from_scratch.engine.allocator sets it
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
BLOCK = 1 << 20


def huge_pages_always() -> bool:
    """Transparent huge pages 'always': a fault maps 2 MiB, so faults do not count 4 KiB pages."""
    with open(THP) as f:
        return "[always]" in f.read()


def layer_step(h: int, a: int, f: int, s: int, b: int):
    """One forward + backward of torch's encoder layer at a calibration shape (the fit's layer)."""
    layer = torch.nn.TransformerEncoderLayer(h, a, f, dropout=0.0, batch_first=True, norm_first=True)
    x = torch.randn(b, s, h, requires_grad=True)
    return lambda: layer(x).sum().backward()


def head_step(T: int, h: int, V: int):
    """One forward + backward of the top (LayerNorm, tied logits, cross-entropy) at T × V (the fit's head)."""
    norm, emb = torch.nn.LayerNorm(h), torch.nn.Embedding(V, h)
    torch.nn.init.normal_(emb.weight, std=0.02)    # as the rows' tables (planner_ranks.Net): no subnormal softmax tail
    x, tgt = torch.randn(T, h, requires_grad=True), torch.randint(0, V, (T,))
    return lambda: torch.nn.functional.cross_entropy(norm(x) @ emb.weight.t(), tgt).backward()


def touched(op, reps: int = 3) -> float:
    """Bytes of fresh pages one op() touches on this thread: the fewest minor faults over `reps`
    calls after a warm-up, × the page size (transparent huge pages not 'always': map_sweep checks)."""
    op()
    faults = []
    for _ in range(reps):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        op()
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
    return min(faults) * resource.getpagesize()


def block_cpu(reps: int) -> float:
    """CPU seconds per byte of writing a fresh BLOCK-byte result (16 per call)."""
    x = torch.ones(BLOCK // 4)

    def sixteen():
        for _ in range(16):
            y = x + 1.0
            del y
    return cpu(sixteen, reps) / (16 * BLOCK)


def map_sweep(rank: int, world: int, layers, reps: int, mapped: bool) -> dict:
    """One process at glibc's defaults (mapped False: the block's cost only), or with the
    threshold fixed before anything is allocated (a freed heap chunk would serve a large block
    before a mapping: the two cannot share a process): the block's cost and the fresh bytes."""
    torch.set_num_threads(1)
    if huge_pages_always():
        raise RuntimeError(f"rank {rank}: {THP} is 'always': page faults do not count the bytes touched; "
                           "no mapped-block fit here")
    if not mapped:
        return {"block_s": block_cpu(reps)}
    if ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, THRESHOLD) != 1:
        raise RuntimeError(f"rank {rank}: glibc refused mallopt(M_MMAP_THRESHOLD, {THRESHOLD}): no mapped-block fit here")
    saved, fresh, logits, head = 0.0, 0.0, 0.0, 0.0
    for h, a, f, s, b in layers:
        if b * s * h * 4 < THRESHOLD:     # its b·s·h blocks stay in the heap: the ratio of a layer too small to map
            continue                      # (its FFN block may still reach 64 KiB), not the one the rows have
        fresh += touched(layer_step(h, a, f, s, b))
        saved += torch_layer_activation_bytes(Model("cal", 1, h, a, 2, s, ffn=f), s, Layout(1, 1, 1, mb=b))
    for T, h, V in HEADS:
        head += touched(head_step(T, h, V))
        logits += 4 * T * V
    return {"block_s": block_cpu(reps), "map_layer": fresh / saved, "map_head": head / logits}


def map_fit(layers, ranks: int = 2, reps: int = 7) -> dict:
    """{mmap_s, map_layer, map_head}: `ranks` processes at once (as training ranks), medians."""
    heap, mapped = (spawn(map_sweep, ranks, args=(layers, reps, m), timeout=600) for m in (False, True))
    med = lambda got, k: statistics.median(g[k] for g in got)  # noqa: E731
    return {"mmap_s": max(0.0, med(mapped, "block_s") - med(heap, "block_s")),
            "map_layer": med(mapped, "map_layer"), "map_head": med(mapped, "map_head")}
