"""What glibc's slack is, shown by replaying a rank's own malloc/free calls: each row of
benchmarks.planner_slack runs with a logging malloc preloaded (LD_PRELOAD, built here with the
system's cc), every call of every rank written per step; the larger rank's calls are then
replayed through glibc in a fresh process, at its defaults, three ways.

    python -m benchmarks.planner_slack_replay --only llama-small   # one row (~1 min idle)
    python -m benchmarks.planner_slack_replay                      # every row of planner_slack
    python -m benchmarks.planner_slack_replay --only llama-small --early   # logged from before the warm-up
    python -m benchmarks.planner_slack_replay --only small --early --risen  # the replays' threshold raised first
    python -m benchmarks.planner_slack_replay --steps 4 --holes              # the heap's free chunks at the live peak

The three replays of the same calls, peak resident set above the replay's start per step:
`as logged` (aligned requests stay aligned: torch asks for every tensor with posix_memalign,
64 bytes), `unaligned` (the same sizes by plain malloc) and `no small blocks` (as logged without
the calls under 64 KiB: the runtime's small objects). Beside them the logged run's own peak
per step and the live bytes of the replayed calls at their peak (the replay's lower bound:
every block mapped). If `as logged` lands near the run and `unaligned` near the live bytes, the
slack is what glibc's memalign does to a heap of freed tensor-sized chunks: it asks its bins for
size + alignment + MINSIZE and splits the chunk it gets, so a freed block never serves the next
request of its own size unless a free neighbour is merged with it, and the runtime's small
blocks, carved from the fragments between, keep such neighbours apart. With --early the log
starts before the warm-up step, so the replay starts from a heap nearer the run's; with --risen
the replays start with glibc's mmap threshold already at the largest logged size, so blocks the
run mapped until the threshold rose come from the heap from the first call. With --holes the calls
are replayed as logged once more, up to the call at which the last step's live bytes peak, and
glibc's malloc_info there gives the heap's free chunks by size (its bins: count × mean size): what
the slack is made of at the moment the live bytes peak.
Memory only: the load does not enter. The logging buffer's pages (32 bytes a call, about
3 MiB a step) add to the logged run's peak. Cost: one run of --steps steps per row plus three
replays of its larger rank.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
from rich.table import Table

import benchmarks.planner_ranks as R
import benchmarks.planner_ranks_tp as RT
from benchmarks.planner_slack import rows
from primitives.launch import spawn
from primitives.log import console

MiB = 2**20
SHIM = r"""
#define _GNU_SOURCE
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <sys/mman.h>
extern void *__libc_malloc(size_t); extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t); extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
typedef struct { uint64_t op, size, p, q; } rec;   /* op 1 malloc, 2 free, 3 realloc (q: old), 4 memalign (q: alignment) */
static rec *buf; static volatile int on; static uint64_t n, cap = 1 << 24;
static void put(uint64_t op, uint64_t size, void *p, uint64_t q) {
  if (!on) return;
  uint64_t i = __atomic_fetch_add(&n, 1, __ATOMIC_RELAXED);
  if (i < cap) { buf[i].op = op; buf[i].size = size; buf[i].p = (uint64_t)p; buf[i].q = q; }
}
void slack_log_start(void) {
  if (!buf) buf = mmap(0, cap * sizeof(rec), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  n = 0; on = 1;
}
long slack_log_stop(const char *path) {
  on = 0; FILE *f = fopen(path, "wb"); uint64_t m = n < cap ? n : cap;
  fwrite(buf, sizeof(rec), m, f); fclose(f); return (long)n;
}
void *malloc(size_t s) { void *p = __libc_malloc(s); put(1, s, p, 0); return p; }
void free(void *p) { if (p) put(2, 0, p, 0); __libc_free(p); }
void *calloc(size_t a, size_t b) { void *p = __libc_calloc(a, b); put(1, a * b, p, 0); return p; }
void *realloc(void *o, size_t s) { void *p = __libc_realloc(o, s); put(3, s, p, (uint64_t)o); return p; }
int posix_memalign(void **r, size_t al, size_t s) {
  void *p = __libc_memalign(al, s); if (!p) return 12; *r = p; put(4, s, p, al); return 0; }
void *aligned_alloc(size_t al, size_t s) { void *p = __libc_memalign(al, s); put(4, s, p, al); return p; }
void *memalign(size_t al, size_t s) { void *p = __libc_memalign(al, s); put(4, s, p, al); return p; }
"""


def build(tmp: str) -> str:
    """The logging malloc as a shared object in `tmp` (system cc)."""
    src, so = os.path.join(tmp, "slack_log.c"), os.path.join(tmp, "slack_log.so")
    with open(src, "w") as f:
        f.write(SHIM)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so, src], check=True)
    return so


def _logged_row(rank, world, so: str, out: str, module: str, fn: str, args: tuple, early: bool = False) -> dict:
    """One rank of a planner_slack row, its malloc calls written to out/rank{rank}_{n}.bin: n = 0
    from the model's construction (with `early`, from before the warm-up) to the first step's end,
    then one file per step."""
    log = ctypes.CDLL(so)      # the preloaded object: dlopen returns the same one
    log.slack_log_stop.restype = ctypes.c_long
    warm, timed = R._warm, R._timed
    if early:
        log.slack_log_start()

    def warm_then_log(*a):
        base = warm(*a)
        if not early:
            log.slack_log_start()
        return base

    def timed_logged(one_step, steps, base):
        done = [0]

        def step():
            one_step()
            log.slack_log_stop(os.path.join(out, f"rank{rank}_{done[0]}.bin").encode())
            done[0] += 1
            log.slack_log_start()
        return timed(step, steps, base)
    for mod in (R, RT):
        mod._warm, mod._timed = warm_then_log, timed_logged
    return getattr(R if module == "R" else RT, fn)(rank, world, *args)


def live_peak(files: list[str]) -> int:
    """The number of calls replayed (all files, as logged) up to the last file's highest live bytes."""
    held, cur, k, best = {}, 0, 0, (-1, 0)
    for i, path in enumerate(files):
        for op, size, p, q in np.fromfile(path, dtype=np.uint64).reshape(-1, 4).tolist():
            k += 1
            if op == 3 and q in held:
                cur -= held.pop(q)
            if op in (1, 3, 4) and p:
                held[p] = size
                cur += size
                if i == len(files) - 1 and cur > best[0]:
                    best = (cur, k)
            elif op == 2 and p in held:
                cur -= held.pop(p)
    return best[1]


def free_chunks(libc) -> list[tuple[int, int, int]]:
    """(smallest size, count, bytes) per bin of the main heap's free chunks, from malloc_info's XML."""
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
        f = libc.fopen(tmp.name.encode(), b"w")
        libc.malloc_info(0, f)
        libc.fclose(f)
        xml = open(tmp.name).read().split('<heap nr="1">')[0]
    return [(int(lo), int(c), int(t)) for lo, t, c in re.findall(r'<(?:size|unsorted) from="(\d+)" to="\d+" total="(\d+)" count="(\d+)"', xml)]


def replay(files: list[str], mode: str, risen: bool = False, stop: int = 0):
    """Replay the logged calls in this process (meant to be a fresh one): mode `logged`,
    `unaligned` or `nosmall`. Per file: (peak resident set above the start, live bytes of the
    replayed blocks at their peak), bytes. Blocks of 4 KiB and more are written, as a tensor is.
    With `stop`, the replay ends after that many calls and returns free_chunks() there.
    With `risen`, glibc's mmap threshold is first raised to its ceiling for the logged sizes (one
    block of the largest size under 32 MiB mapped and freed) instead of rising as the run's did."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = libc.realloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]

    def vm(key):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))
    logs = [np.fromfile(path, dtype=np.uint64).reshape(-1, 4).tolist() for path in files]
    if risen:
        big = max(size for log in logs for op, size, p, q in log if op in (1, 3, 4) and size < 32 * MiB)
        a = libc.malloc(big + 8192)
        libc.memset(a, 1, big)
        libc.free(a)
    held, cur, out, base, k = {}, 0, [], vm("VmRSS"), 0
    for log in logs:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        peak = cur
        for op, size, p, q in log:
            if k == stop > 0:
                return free_chunks(libc)
            k += 1
            if op == 3:                        # realloc: the old block goes, a new one comes
                if q in held:
                    a, n = held.pop(q)
                    libc.free(a)
                    cur -= n
                op = 1
            if op in (1, 4) and p:
                if mode == "nosmall" and size < 65536:
                    continue
                if op == 4 and mode != "unaligned":
                    r = ctypes.c_void_p()
                    libc.posix_memalign(ctypes.byref(r), q, size)
                    a = r.value
                else:
                    a = libc.malloc(size)
                if size >= 4096:
                    libc.memset(a, 1, size)
                held[p] = (a, size)
                cur += size
                peak = max(peak, cur)
            elif op == 2 and p in held:
                a, n = held.pop(p)
                libc.free(a)
                cur -= n
        out.append((vm("VmHWM") - base, peak))
    return free_chunks(libc) if stop else out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose name contains this text")
    ap.add_argument("--steps", type=int, default=3, help="steps per run")
    ap.add_argument("--early", action="store_true", help="log from before the warm-up step, not from the model's construction")
    ap.add_argument("--risen", action="store_true", help="the replays start with glibc's mmap threshold raised (see replay)")
    ap.add_argument("--holes", action="store_true", help="the heap's free chunks at the last step's live peak (malloc_info)")
    ap.add_argument("--replay", nargs="+", help=argparse.SUPPRESS)     # MODE RISEN STOP FILE...: the fresh replaying process
    a = ap.parse_args(argv)
    if a.replay:
        print(json.dumps(replay(a.replay[3:], a.replay[0], a.replay[1] == "risen", int(a.replay[2]))))
        return 0
    if a.steps < 2 or not any(a.only in r[0] for r in rows(a.steps)):
        ap.error(f"--steps {a.steps}: expected at least 2" if a.steps < 2 else f"--only {a.only!r}: no row of "
                 f"benchmarks.planner_slack contains it ({', '.join(r[0] for r in rows(a.steps))})")
    t = Table(title="glibc's slack replayed: the larger rank's peak per step above its start (MiB)")
    for c in ("row", "rank", "logged run", "replay as logged", "unaligned", "no small blocks", "live at the peak") \
            + (("free at the live peak", "its chunks ≥ 64 KiB (count × mean KiB)") if a.holes else ()):
        t.add_column(c, justify="right")
    with tempfile.TemporaryDirectory(prefix="ringzero-slack-") as tmp:
        so = build(tmp)
        os.environ["LD_PRELOAD"] = so      # read when a process starts: the fork server passes it on
        for name, m, lay, batch, module, fn, args in rows(a.steps):
            if a.only not in name:
                continue
            out = os.path.join(tmp, name.replace(" ", "_"))
            os.makedirs(out)
            got = spawn(_logged_row, lay.gpus, args=(so, out, module, fn, args, a.early), timeout=900)
            r = max(range(len(got)), key=lambda i: got[i]["peak"])
            files = [os.path.join(out, f"rank{r}_{n}.bin") for n in range(a.steps)]
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            run = lambda mode, stop=0: json.loads(subprocess.run(
                [sys.executable, "-m", "benchmarks.planner_slack_replay", "--replay", mode, "risen" if a.risen else "-", str(stop), *files],
                env=env, check=True, capture_output=True, text=True).stdout)
            res = {mode: run(mode) for mode in ("logged", "unaligned", "nosmall")}
            holes = run("logged", live_peak(files)) if a.holes else []
            big = sorted(((c, t) for lo, c, t in holes if lo >= 65536 and c), key=lambda ct: -ct[1])
            steps = lambda xs: " ".join(f"{x / MiB:.0f}" for x in xs)
            t.add_row(name, str(r), steps(got[r]["peaks"]), *(steps(h for h, _ in res[k]) for k in ("logged", "unaligned", "nosmall")),
                      steps(p for _, p in res["logged"]),
                      *((f"{sum(t for _, _, t in holes) / MiB:.1f}", ", ".join(f"{c}×{t / c / 1024:.0f}" for c, t in big[:4])) if a.holes else ()))
        os.environ.pop("LD_PRELOAD")
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
