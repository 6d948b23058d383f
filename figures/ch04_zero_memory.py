"""Chapter 04's pictures: model-state bytes per rank per ZeRO stage, and who holds what.

    python -m figures.ch04_zero_memory

Numbers come from zero_from_scratch.engine.report (the engine's own layout function on the real
DistilBERT-base shapes, built on the meta device: no training, a few seconds) — the same
tables `python -m zero_from_scratch.engine.report` prints — next to the ZeRO paper's formula.
"""
from __future__ import annotations

from figures.common import pyplot, save
from zero_from_scratch.engine.report import layouts, build, tables

PARTS = ("params", "grads", "master", "optimizer")
COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "master": "#8172b3", "optimizer": "#55a868"}


def bars(n: int = 2) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, mixed in zip(axes, (False, True)):
        _, _, data = tables("distilbert", n, mixed)
        bottom = [0.0] * 4
        for part in PARTS:
            vals = [data[s]["engine"][part] / 2**20 for s in range(4)]
            ax.bar([f"ZeRO-{s}" for s in range(4)], vals, bottom=bottom, color=COLOURS[part], label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        paper = [sum(data[s]["paper"].values()) / 2**20 for s in range(4)]
        ax.plot(range(4), paper, "k_", markersize=28, mew=2, label="paper formula at Ψ")
        for s, tot in enumerate(bottom):
            ax.text(s, tot, f"{tot:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(("bf16 + fp32 master" if mixed else "fp32") + f", N = {n}")
        ax.set_ylabel("MiB per rank (model states)")
    axes[0].legend(fontsize=8)
    fig.suptitle("DistilBERT-base (Ψ = 66,955,010): what each rank holds, by ZeRO stage")
    return save(fig, "04_zero_memory_bars", "figures.ch04_zero_memory",
                note="engine bytes at the padded count, from zero_from_scratch.engine.report")


def ownership(n: int = 4) -> str:
    """Rows = ranks, columns = the flat parameter vector: which slice of params, grads and
    optimizer states each rank keeps, per stage (drawn from shard_layout's real offsets)."""
    plt = pyplot()
    lays = layouts(build("distilbert"), n)
    fig, axes = plt.subplots(4, 1, figsize=(9, 6.5), sharex=True)
    kept = {0: ("params", "grads", "optimizer"), 1: ("params", "grads"), 2: ("params",), 3: ()}
    for s, ax in enumerate(axes):
        lay = lays[s]
        total = lay.padded
        for r in range(n):
            for j, part in enumerate(("params", "grads", "optimizer")):
                y = r + j * 0.27 - 0.27
                if part in kept[s]:      # replicated: the whole vector
                    ax.barh(y, total, height=0.25, color=COLOURS[part], alpha=0.35)
                else:                    # sharded: this rank's slice of every unit
                    start = 0
                    for u in lay.units:
                        lo, hi = u.shard_range(r)
                        ax.barh(y, hi - lo, left=start + lo, height=0.25, color=COLOURS[part])
                        start += u.padded
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
        ax.set_ylim(n - 0.5, -0.7)
        ax.set_title(f"ZeRO-{s}: " + ("everything replicated" if s == 0 else
                                      "sharded: " + ", ".join(p for p in ("optimizer", "grads", "params")
                                                               if p not in kept[s])), fontsize=9, loc="left")
    axes[-1].set_xlabel("position in the flat parameter vector (elements)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[p]) for p in ("params", "grads", "optimizer")]
    fig.legend(handles, ["parameters", "gradients", "optimizer states"], loc="upper right", fontsize=8)
    fig.suptitle(f"Who holds what, DistilBERT-base, N = {n} (pale = full replica, solid = own shard)")
    return save(fig, "04_zero_ownership", "figures.ch04_zero_memory",
                note="offsets from zero_from_scratch.sharding.shard_layout")


def main() -> list[str]:
    return [bars(), ownership()]


if __name__ == "__main__":
    for p in main():
        print(p)
