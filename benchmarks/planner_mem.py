"""What the measured peak memory of benchmarks.planner_local's rows consists of, per rank:
anonymous memory (glibc's heap and arenas, mapped blocks), file-backed pages (code of torch's
kernels touched after the baseline), shared memory, and the threads started after it.

    python -m benchmarks.planner_mem                    # every row of benchmarks.planner_local (~5 min idle)
    python -m benchmarks.planner_mem --only llama       # rows whose name contains the text
    python -m benchmarks.planner_mem --mapped           # every large block mapped: no slack

Each row runs as planner_local runs it (the same rank functions, the same baseline and peak),
with /proc/self/status's RssAnon, RssFile, RssShmem, glibc's mallinfo2 (heap bytes in use
and free, mapped blocks) and the thread count read at the baseline and after every step. File
and shared pages are not given back during a run, so their value after the steps bounds the one
at the peak; the anonymous part at the peak is the peak less those two. Memory only: the load
does not enter. Beside each row: the planner's prediction without glibc's slack
(planner.memory, its `runtime` term included), and with --mapped the same row with glibc's mmap
threshold fixed at 64 KiB (no slack): at the defaults less mapped is the slack. Cost: one run of
3 steps per row, 2-8 ranks each (the 2-node row is left out).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
from dataclasses import replace

from rich.table import Table

import benchmarks.planner_ranks as R
import benchmarks.planner_ranks_tp as RT
from benchmarks.planner_local import LOCAL_SW, runs
from benchmarks.planner_nodes import on_two_nodes
from planner import hardware as H
from planner.memory import memory
from primitives.launch import spawn
from primitives.log import console

MiB = 2**20
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in FIELDS]


def snapshot() -> dict:
    """The resident set's parts (/proc/self/status), mallinfo2 and the thread count of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            k, _, v = ln.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    mi = libc.mallinfo2()
    out.update({f: getattr(mi, f) for f in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost")})
    out["threads"] = len(os.listdir("/proc/self/task"))
    return out


def arenas() -> list[int]:
    """Bytes each glibc arena holds from the system (malloc_info's per-heap "current" size)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.open_memstream.restype = ctypes.c_void_p
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    xml = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    heaps = re.findall(r'<heap nr="\d+">(.*?)</heap>', xml, re.S)
    return [int(re.search(r'<system type="current" size="(\d+)"/>', h).group(1)) for h in heaps]


def _row(rank, world, mapped: bool, fn, args: tuple) -> dict:
    """One rank of a planner_local row with snapshots at the baseline and after each step."""
    if mapped:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)     # M_MMAP_THRESHOLD
    warm, timed, snaps = R._warm, R._timed, {}

    def warm_and_read(*a):
        base = warm(*a)
        snaps["base"] = snapshot()
        return base

    def timed_and_read(one_step, steps, base):
        def step():
            one_step()
            snaps.setdefault("steps", []).append(snapshot())
        return timed(step, steps, base)
    for mod in (R, RT):
        mod._warm, mod._timed = warm_and_read, timed_and_read
    out = fn(rank, world, *args)
    return {**out, **snaps, "arenas": arenas()}


def parts(g: dict) -> dict:
    """MiB above the baseline at the peak: the whole, file pages, shared pages, anonymous, heap."""
    b, last = g["base"], g["steps"][-1]
    file = max(s["RssFile"] for s in g["steps"]) - b["RssFile"]
    shm = max(s["RssShmem"] for s in g["steps"]) - b["RssShmem"]
    return {"peak": g["peak"] / MiB, "file": file / MiB, "shm": shm / MiB, "anon": (g["peak"] - file - shm) / MiB,
            "heap": (last["arena"] - b["arena"]) / MiB, "heap free": last["fordblks"] / MiB,
            "mapped": (last["hblkhd"] - b["hblkhd"]) / MiB, "threads": last["threads"] - b["threads"],
            "step peaks": " ".join(f"{(s['VmHWM'] - g['base']['VmRSS']) / MiB:.0f}" for s in g["steps"]),
            "arenas": " ".join(f"{x / MiB:.0f}" for x in g["arenas"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose name contains this text")
    ap.add_argument("--mapped", action="store_true", help="glibc's mmap threshold fixed at 64 KiB (no slack)")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    names = [f"{m.name} {label}" for m, label, *_, fn, _ in runs(False, max(a.steps, 2)) if fn is not on_two_nodes]
    if a.steps < 2 or not any(a.only in n for n in names):      # the 2-node row is not split here
        ap.error(f"--steps {a.steps}: expected at least 2" if a.steps < 2 else
                 f"--only {a.only!r}: no row contains it; the rows (the 2-node row is not split): {', '.join(names)}")
    t = Table(title=f"the peak per rank above the baseline, its parts (MiB){' (mapped)' if a.mapped else ''}")
    cols = ("peak", "file", "shm", "anon", "heap", "heap free", "mapped", "threads", "arenas", "step peaks")
    for c in ("row", "rank", *cols, "planner w/o slack"):
        t.add_column(c, justify="right")
    for m, label, lay, batch, fn, args in runs(False, a.steps):
        name = f"{m.name} {label}"
        if a.only not in name or fn is on_two_nodes:
            continue
        got = spawn(_row, lay.gpus, args=(a.mapped, fn, args), timeout=900)
        pred = memory(m, m.seq, lay, batch, H.cpu_here(lay.gpus), replace(LOCAL_SW, mapped_alloc=True))   # without slack
        for r, g in enumerate(got):
            p = parts(g)
            t.add_row(name, str(r), *(f"{p[c]:.1f}" if isinstance(p[c], float) else str(p[c]) for c in cols),
                      f"{(pred['total'] - pred['reserved']) / MiB:.1f}")
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
