"""Chapter 03's picture: when each gradient bucket's all-reduce runs during backward, for the
flat chapter (one all-reduce after backward) and the bucketed one (buckets launched from the
gradient hooks while backward goes on). Measured on 2 spawned gloo ranks, a few seconds.

    python -m figures.ch03_overlap

Backward compute is timed with per-layer backward hooks; communication with the ledger's own
call record (entered on the worker thread exactly around the data movement), so each bar is
when bytes really moved. On 2 shared cores there is no idle core for the overlap to use: the
picture shows the *schedule* (bucket k moves while layer k-1 computes), the chapter's table
shows what it does (and does not) buy here.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ddp_examples.engine.common import Config, build_model, make_batch
from ddp_examples.engine.wrappers import BucketedDataParallel, FlatDataParallel
from figures.common import pyplot, save
from primitives.launch import spawn
from primitives.engine.ledger import LEDGER

CFG = dict(depth=6, hidden=768, in_dim=768, classes=8, global_batch=64, steps=1, bucket_cap_mb=4.0)


def _record(rank, world, chapter):
    cfg = Config(**CFG)
    model = build_model(cfg)
    dp = FlatDataParallel(model) if chapter == "flat" else BucketedDataParallel(model, cfg.bucket_cap_mb)
    events, t0 = [], [0.0]
    orig_call = LEDGER.call

    @contextlib.contextmanager
    def call(name, algorithm, nbytes):
        s = time.perf_counter() - t0[0]
        with orig_call(name, algorithm, nbytes) as rec:
            yield rec
        events.append(("comm", s, time.perf_counter() - t0[0], nbytes))

    last = [0.0]

    def hook(mod, gin, gout):
        now = time.perf_counter() - t0[0]
        events.append(("compute", last[0], now, 0))
        last[0] = now

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_full_backward_hook(hook)
    LEDGER.call = call
    for step in range(3):                       # the last step is the one drawn (warm)
        events.clear()
        x, y = make_batch(cfg, step)
        n = x.shape[0] // world
        out = dp(x[rank * n:(rank + 1) * n])
        loss = torch.nn.functional.cross_entropy(out, y[rank * n:(rank + 1) * n])
        t0[0] = time.perf_counter()
        last[0] = 0.0
        loss.backward()                          # bucketed: returns after every bucket was waited for
        if hasattr(dp, "sync_gradients"):        # flat: one all-reduce once backward is done
            dp.sync_gradients()
        end = time.perf_counter() - t0[0]
    LEDGER.call = orig_call
    return events, end


def record(chapter: str) -> list:
    return spawn(_record, 2, args=(chapter,), timeout=180)


def main() -> list[str]:
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True)
    for ax, chapter, title in zip(axes, ("flat", "bucketed"),
                                  ("chapter 3, flat: one all-reduce after backward",
                                   "chapter 4, bucketed: each bucket's all-reduce starts from the gradient hooks")):
        res = record(chapter)
        for r, (events, end) in enumerate(res):
            y = r * 2
            for kind, s, e, nbytes in events:
                if kind == "compute":
                    ax.barh(y + 0.5, (e - s) * 1e3, left=s * 1e3, height=0.7, color="#4c72b0", edgecolor="white")
                else:
                    ax.barh(y - 0.4, (e - s) * 1e3, left=s * 1e3, height=0.7, color="#dd8452", edgecolor="k", lw=0.5)
                    ax.text((s + e) / 2 * 1e3, y - 0.4, f"{nbytes / 2**20:.1f}M", ha="center", va="center", fontsize=6)
            ax.plot([end * 1e3] * 2, [y - 1, y + 1], color="0.4", lw=0.8, ls=":")
        ax.set_yticks([0.5, -0.4, 2.5, 1.6], ["rank 0 backward", "rank 0 all-reduce", "rank 1 backward", "rank 1 all-reduce"],
                      fontsize=7)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since backward started (dotted: gradients averaged on that rank)")
    fig.suptitle(f"Backward vs gradient all-reduce, {CFG['depth'] + 1} linear layers of {CFG['hidden']}, "
                 f"buckets of {CFG['bucket_cap_mb']:.0f} MB, 2 ranks", fontsize=10)
    return [save(fig, "03_overlap_timeline", "figures.ch03_overlap",
                 note="compute from backward hooks, communication from the ledger's call records, third step of three")]


if __name__ == "__main__":
    for p in main():
        print(p)
