"""Tutorial 10's pictures, drawn from the same code that shards (no processes needed).

    python -m figures.ch10_tensor_parallel       # writes tutorials/img/10_mesh.png, 10_shards.png

10_mesh.png     the dp × pp × tp mesh of primitives.mesh.Layout: every global rank in its
                (pipeline stage, data replica, tensor shard) cell, tp ranks adjacent.
10_shards.png   which tp rank holds which slice of each DistilBERT weight, by
                tensor_parallel.layers.shard_bounds (heads kept whole; uneven splits shown).
"""
from __future__ import annotations

from figures.common import pyplot, save
from primitives.mesh import Layout
from tensor_parallel.layers import shard_bounds

plt = pyplot()
COLORS = plt.get_cmap("tab10").colors
SOURCE = "figures.ch10_tensor_parallel"


def draw_mesh(dp: int = 2, pp: int = 2, tp: int = 2) -> None:
    lay = Layout(dp=dp, pp=pp, tp=tp)
    fig, ax = plt.subplots(figsize=(2.6 * pp + 1, 1.3 * dp + 1.2))
    for r in range(lay.world):
        p, d, t = lay.coords_of(r)
        x, y = p * (tp + 0.6) + t, (dp - 1 - d) * 1.2
        ax.add_patch(plt.Rectangle((x, y), 0.92, 0.92, color=COLORS[t], alpha=0.85))
        ax.text(x + 0.46, y + 0.46, f"rank {r}\ntp {t}", ha="center", va="center", fontsize=9, color="white")
    for p in range(pp):
        ax.text(p * (tp + 0.6) + tp / 2 - 0.04, dp * 1.2 + 0.05, f"pipeline stage {p}", ha="center", fontsize=10)
    for d in range(dp):
        ax.text(-0.15, (dp - 1 - d) * 1.2 + 0.46, f"dp replica {d}", ha="right", va="center", fontsize=10)
    ax.set_xlim(-1.6, pp * (tp + 0.6))
    ax.set_ylim(-0.3, dp * 1.2 + 0.4)
    ax.axis("off")
    ax.set_title(f"primitives.mesh: dp={dp} × pp={pp} × tp={tp}, rank = (pp·dp + dp_index)·tp + tp_index",
                 fontsize=10)
    return save(fig, "10_mesh", SOURCE, note="from primitives.mesh.Layout")


def draw_shards(tp: int = 5, dim: int = 384, heads: int = 12, ffn: int = 1536, vocab: int = 30522) -> None:
    hd = dim // heads
    rows = [  # (label, size, unit, what is split)
        ("word_embeddings rows (vocab)", vocab, 1, "VocabParallelEmbedding"),
        ("q_lin / k_lin / v_lin rows (heads)", dim, hd, "column-parallel"),
        ("out_lin columns (heads)", dim, hd, "row-parallel"),
        ("ffn.lin1 rows", ffn, 1, "column-parallel"),
        ("ffn.lin2 columns", ffn, 1, "row-parallel"),
    ]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for i, (label, size, unit, kind) in enumerate(rows):
        y = len(rows) - 1 - i
        for r in range(tp):
            lo, hi = shard_bounds(size, tp, r, unit)
            ax.barh(y, (hi - lo) / size, left=lo / size, color=COLORS[r], edgecolor="white")
            txt = f"{(hi - lo) // unit} heads" if unit > 1 else f"[{lo}, {hi})"
            ax.text((lo + hi) / 2 / size, y, f"rank {r}\n{txt}", ha="center", va="center", fontsize=6.5, color="white")
        ax.text(1.01, y, kind, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of the dimension")
    ax.set_title(f"DistilBERT (dim {dim}, {heads} heads, FFN {ffn}, vocab {vocab}) at tp={tp}: who holds what\n"
                 "uneven splits follow torch.tensor_split; LayerNorms, position embeddings, classifier: every rank",
                 fontsize=9)
    return save(fig, "10_shards", SOURCE, note="from tensor_parallel.layers.shard_bounds")


def main() -> list[str]:
    return [draw_mesh(), draw_shards()]


if __name__ == "__main__":
    for p in main():
        print(p)
