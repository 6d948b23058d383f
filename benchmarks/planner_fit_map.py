"""Fresh mappings, fitted for the planner: how many bytes a step maps afresh when glibc maps every
large block, and what a CPU second of mapping buys (benchmarks.planner_fit).

    python -m benchmarks.planner_fit --engine       # refits these with the whole-step terms (~3 min idle)

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
                reused heap block, on whole training steps: the calibration shape's DDP step in
                one process (planner.host_memory.SLACK_CAL, micro-batch 4, AdamW, the flat
                gradient copy; no process group) at glibc's defaults and with the threshold fixed
                at 64 KiB, the CPU seconds the mapped step adds over the bytes it touches afresh:
                the pages the rows map, in the order they do (among them Adam's temporaries and
                the flat copy, which planner.steptime counts beside the layers'). A 1 MiB block
                written once alone, in the same processes, is printed beside it (mmap_block_s)

Bytes are counted by the thread's minor page faults (getrusage, 4 KiB pages: refused when
transparent huge pages are 'always'); mmap_s is the only timing. Cost: a few dozen layer and head
steps per process, and ROUNDS × 2 launches of STEPS + 2 calibration steps, ~1 min.
"""
from __future__ import annotations

import ctypes
import resource
import statistics
import time

import torch

from benchmarks.planner_fit_loss import HEADS, cpu
from benchmarks.planner_ranks import Net
from planner.host_memory import SLACK_CAL
from planner.layout import Layout
from planner.memory import torch_layer_activation_bytes
from planner.model import Model
from primitives.launch import spawn

M_MMAP_THRESHOLD, THRESHOLD = -3, 64 << 10        # as zero_from_scratch.engine.allocator sets it
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
STEPS, ROUNDS = 6, 3      # timed calibration steps per launch; launches of each allocator, alternated
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


def cal_steps(steps: int) -> dict:
    """{step_s, step_fresh, tail_fresh}: the median CPU seconds and fresh bytes (minor faults × the
    page size) of SLACK_CAL's DDP step in this process after two warm-up steps: forward and loss,
    backward, the gradients' flat copy (planner_ranks._rank's, without its all-reduce), AdamW's
    step; and of the last two alone (what planner.steptime maps beside the layers and the top)."""
    torch.manual_seed(0)
    net = Net(SLACK_CAL)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(0, SLACK_CAL.vocab, (4, SLACK_CAL.seq), generator=torch.Generator().manual_seed(0))
    faults = lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_minflt * resource.getpagesize()  # noqa: E731
    cpus, fresh, tail = [], [], []
    for i in range(steps + 2):
        f0, t0 = faults(), time.thread_time()
        torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
        f1 = faults()
        flat = torch.cat([p.grad.flatten() for p in net.parameters()])
        del flat
        opt.step()
        opt.zero_grad(set_to_none=False)
        if i >= 2:
            cpus.append(time.thread_time() - t0)
            fresh.append(faults() - f0)
            tail.append(faults() - f1)
    return {"step_s": statistics.median(cpus), "step_fresh": statistics.median(fresh), "tail_fresh": statistics.median(tail)}


def block_cpu(reps: int = 7) -> float:
    """CPU seconds per byte of writing a fresh BLOCK-byte result alone (16 per call): a page's cost
    without a step around it, printed beside mmap_s for comparison."""
    x = torch.ones(BLOCK // 4)

    def sixteen():
        for _ in range(16):
            y = x + 1.0
            del y
    return cpu(sixteen, reps) / (16 * BLOCK)


def map_sweep(rank: int, world: int, layers, steps: int, mapped: bool) -> dict:
    """One process at glibc's defaults (mapped False: the calibration step only, cal_steps), or
    with the threshold fixed before anything is allocated (a freed heap chunk would serve a large
    block before a mapping: the two cannot share a process): also the layers' and heads' fresh bytes."""
    torch.set_num_threads(1)
    if huge_pages_always():
        raise RuntimeError(f"rank {rank}: {THP} is 'always': page faults do not count the bytes touched; "
                           "no mapped-block fit here")
    if not mapped:
        return {**cal_steps(steps), "block_s": block_cpu()}
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
    return {**cal_steps(steps), "block_s": block_cpu(), "map_layer": fresh / saved, "map_head": head / logits}


def map_fit(layers, ranks: int = 2) -> dict:
    """{mmap_s, map_layer, map_head, mmap_block_s}: `ranks` processes at once (as training ranks),
    ROUNDS launches of each allocator in turn (the machine's speed moves between launches); mmap_s
    the median over rounds of the mapped step's extra CPU seconds over its extra fresh bytes, each
    the ranks' median; mmap_block_s the same for a 1 MiB block alone (block_cpu: printed, not used)."""
    med = lambda got, k: statistics.median(g[k] for g in got)  # noqa: E731
    per_byte, block, mapped = [], [], []
    for _ in range(ROUNDS):
        heap = spawn(map_sweep, ranks, args=(layers, STEPS, False), timeout=600)
        mapped = spawn(map_sweep, ranks, args=(layers, STEPS, True), timeout=600)
        extra = med(mapped, "step_fresh") - med(heap, "step_fresh")
        if extra <= 0:
            raise RuntimeError(f"the mapped step touched no more fresh bytes than the heap's ({extra:.0f}): "
                               "is glibc's mmap threshold fixed? no mapped-block fit here")
        per_byte.append((med(mapped, "step_s") - med(heap, "step_s")) / extra)
        block.append(med(mapped, "block_s") - med(heap, "block_s"))
    return {"mmap_s": max(0.0, statistics.median(per_byte)), "map_layer": med(mapped, "map_layer"),
            "map_head": med(mapped, "map_head"), "mmap_block_s": statistics.median(block)}
