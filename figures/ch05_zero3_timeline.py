"""Chapter 05's picture: ZeRO-3 over one training step — when each module's parameters are
gathered (demand or prefetch), used and freed, and the live gathered bytes over time. Recorded
from a real run (2 spawned gloo ranks, a small transformer-like stack, a few seconds), with
prefetch on and off, and stage3_max_reuse_distance = 0 so every module is freed after each use.

    python -m figures.ch05_zero3_timeline

Recorded from outside, through torch's module hooks: a hook registered after the engine's own
(forward pre/post, backward pre/post, on every module) compares the units whose full
parameters are gathered (the stage's `full_of`, unit -> gathered buffer) with the last look and
notes (time, install/release, unit, live bytes), the live bytes being the engine's own count
(prefetch.py's `live`: gathered and in-flight, what stage3_max_live_parameters bounds).
Events land at module boundaries, which is where ZeRO-3 gathers and releases.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from figures.common import pyplot, save
import zero_from_scratch
from primitives.launch import spawn

WIDTH, DEPTH, BATCH = 256, 6, 16


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def _record(rank, world, prefetch):
    model = _model()
    # reuse distance 0: free after each use, so backward gathers again (DeepSpeed's default keeps a
    # small model's parameters gathered from forward to backward, which hides the pattern)
    zcfg = {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": prefetch,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 2 * WIDTH * WIDTH if prefetch else 0}
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zcfg}
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    st = engine.stage
    events, t0, seen = [], [time.perf_counter()], [set()]
    elem = torch.empty(0, dtype=engine.dtype).element_size()

    def look(*_):
        now, t = set(st.full_of), time.perf_counter() - t0[0]
        live = st.pf.live * elem                # the engine's count: gathered + in-flight prefetch
        events.extend((t, "install", i, live) for i in sorted(now - seen[0]))
        events.extend((t, "release", i, live) for i in sorted(seen[0] - now))
        seen[0] = now
    for m in engine.module.modules():          # after the engine's hooks: they run first
        m.register_forward_pre_hook(look)
        m.register_forward_hook(look)
        m.register_full_backward_pre_hook(look)
        m.register_full_backward_hook(look)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):                      # step 1 records the trace; the last one is drawn
        events.clear()
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        t0[0] = time.perf_counter()
        loss = nn.functional.cross_entropy(engine(x), y)
        t_fwd = time.perf_counter() - t0[0]
        engine.backward(loss)
        engine.step()
        look()
        t_end = time.perf_counter() - t0[0]
    kinds = dict(engine.module.named_modules())
    names = [f"{u.tag} {type(kinds[u.tag]).__name__}" if u.tag in kinds else str(u.tag) for u in engine.layout.units]
    return events, names, t_fwd, t_end, dict(st.stats)


def main() -> list[str]:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), gridspec_kw={"height_ratios": [3, 1]}, sharex="col")
    for col, prefetch in enumerate((False, True)):
        events, names, t_fwd, t_end, stats = spawn(_record, 2, args=(prefetch,), timeout=180)[0]
        ax, mem = axes[0][col], axes[1][col]
        open_at, floor = {}, t_end * 1e3 * 0.004     # a floor so sub-millisecond spans stay visible
        for t, ev, unit, live in events:
            if ev == "install":
                open_at[unit] = t
            elif ev == "release" and unit in open_at:
                s = open_at.pop(unit)
                ax.barh(unit, max((t - s) * 1e3, floor), left=s * 1e3, color="#4c72b0" if s < t_fwd else "#dd8452",
                        height=0.7)
        for unit, s in open_at.items():
            ax.barh(unit, (t_end - s) * 1e3, left=s * 1e3, color="0.6", height=0.7)
        ax.axvline(t_fwd * 1e3, color="k", ls=":", lw=0.8)
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.invert_yaxis()
        ax.set_title(("prefetch on" if prefetch else "prefetch off") +
                     f": {stats.get('demand', 0)} demand gathers, {stats.get('prefetch', 0)} prefetched", fontsize=9)
        ts = [e[0] * 1e3 for e in events]
        mem.step(ts, [e[3] / 2**20 for e in events], where="post", color="#55a868")
        mem.set_ylabel("live MiB", fontsize=8)
        mem.set_xlabel("ms into the step (dotted: forward ends)")
    fig.suptitle(f"ZeRO-3, one step, rank 0 of 2: each module's full parameters live from gather to release "
                 f"(blue: gathered in forward, orange: in backward)", fontsize=9)
    return [save(fig, "05_zero3_timeline", "figures.ch05_zero3_timeline",
                 note="recorded through module hooks on a real run (the stage's gathered units at each module boundary)")]


if __name__ == "__main__":
    for p in main():
        print(p)
