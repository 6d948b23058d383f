"""Chapter 02's ring picture: which chunk every rank sends at every step of a ring all-reduce
on N = 4 ranks, recorded from a real run (4 spawned gloo ranks, a few seconds).

    python -m figures.ch02_ring

Each rank wraps its communicator's transport hook `_isend` to note (step, peer, which chunk of the buffer the
message starts in), runs `primitives.all_reduce(x, algorithm="ring")`, and checks the message
count and bytes against the ledger's call record (2(N-1) messages, 2(N-1)/N·S bytes). The first
N-1 steps are the reduce-scatter (partial sums travel), the last N-1 the all-gather (finished
chunks travel).
"""
from __future__ import annotations

import torch

import primitives
from figures.common import pyplot, save
from primitives.engine.launch import spawn
from primitives.engine.ledger import LEDGER
from primitives.engine.registry import get_comm

N, NUMEL = 4, 4096


def _record(rank, world):
    comm = get_comm()
    x = torch.zeros(NUMEL)
    base, esz, chunk = x.data_ptr(), x.element_size(), NUMEL // world
    sent = []
    orig = comm._isend         # the transport's post: every message of every algorithm passes here

    def isend(t, peer):
        if t.data_ptr() >= base and t.data_ptr() < base + NUMEL * esz:   # a view of x: which chunk?
            sent.append((len(sent), peer, (t.data_ptr() - base) // esz // chunk))
        else:                                                            # from a scratch buffer
            sent.append((len(sent), peer, None))
        return orig(t, peer)

    comm._isend = isend
    LEDGER.reset()
    primitives.all_reduce(x, algorithm="ring")
    del comm._isend
    rec = [c for c in LEDGER.calls if c.name == "all_reduce"][-1]
    return sent, rec.counts.msgs_sent, rec.counts.bytes_sent


def record() -> list:
    res = spawn(_record, N, timeout=120)
    for r, (sent, msgs, nbytes) in enumerate(res):
        data = [s for s in sent if s[2] is not None]
        assert len(data) == msgs == 2 * (N - 1), (r, len(data), msgs)
        assert nbytes == 2 * (N - 1) * NUMEL * 4 // N, (r, nbytes)
    # number the data messages only (the safety check's control messages are not chunks)
    return [[(i, peer, c) for i, (_, peer, c) in enumerate(s for s in sent if s[2] is not None)]
            for sent, _, _ in res]


def main() -> list[str]:
    sends = record()
    plt = pyplot()
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    steps = 2 * (N - 1)
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for r, rows in enumerate(sends):
        for step, peer, c in rows:
            rs = step < N - 1
            ax.add_patch(plt.Rectangle((step, r - 0.4), 0.92, 0.8, color=colours[c], alpha=0.55 if rs else 0.95,
                                       hatch="//" if rs else None, lw=0))
            ax.text(step + 0.46, r, f"chunk {c}\n→ rank {peer}", ha="center", va="center", fontsize=7)
    ax.axvline(N - 1 - 0.04, color="k", lw=1, ls="--")
    ax.text((N - 1) / 2, -0.75, "reduce-scatter: partial sums travel", ha="center", fontsize=8)
    ax.text(N - 1 + (N - 1) / 2, -0.75, "all-gather: finished chunks travel", ha="center", fontsize=8)
    ax.set_xlim(-0.1, steps)
    ax.set_ylim(N - 0.5, -1.0)
    ax.set_xticks([s + 0.46 for s in range(steps)], [f"step {s + 1}" for s in range(steps)], fontsize=8)
    ax.set_yticks(range(N), [f"rank {r}" for r in range(N)], fontsize=8)
    ax.set_title(f"Ring all-reduce, N = {N}: every rank sends one chunk (S/N bytes) per step, "
                 f"2(N−1) = {steps} steps, 2(N−1)/N·S bytes each", fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return [save(fig, "02_ring_chunks", "figures.ch02_ring",
                 note="recorded from primitives.all_reduce(algorithm='ring') on 4 gloo ranks; counts checked against the ledger")]


if __name__ == "__main__":
    for p in main():
        print(p)
