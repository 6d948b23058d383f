"""Chapter 02's ring picture: which chunk every rank sends at every step of a ring all-reduce
on N = 4 ranks, recorded from a real run (4 spawned gloo ranks, a few seconds).

    python -m figures.ch02_ring

Each rank runs `primitives.all_reduce(x, group=rec, algorithm="ring")` on a recording
Communicator (primitives/engine/recording.py: every message posted through the Communicator's
interface, the check round's marked as control), notes (step, peer, which chunk of the buffer
each data message starts in), and checks the message count and bytes against the ledger's call
record (2(N-1) messages, 2(N-1)/N·S bytes). The first N-1 steps are the reduce-scatter (partial
sums travel), the last N-1 the all-gather (finished chunks travel).
"""
from __future__ import annotations

import torch

import primitives
from figures.common import pyplot, save
from primitives.launch import spawn
from primitives.engine.ledger import LEDGER
from primitives.engine.recording import Recording
from primitives.engine.registry import get_comm

N, NUMEL = 4, 4096


def _record(rank, world):
    rec = Recording(get_comm())
    x = torch.zeros(NUMEL)
    base, esz, chunk = x.data_ptr(), x.element_size(), NUMEL // world
    LEDGER.reset()
    primitives.all_reduce(x, group=rec, algorithm="ring")
    sent = []
    for m in rec.sends():                   # the algorithm's data messages, in posting order
        p = m.tensor.data_ptr()
        inside = base <= p < base + NUMEL * esz                        # a view of x: which chunk?
        sent.append((len(sent), m.peer, (p - base) // esz // chunk if inside else None))
    rec_call = [c for c in LEDGER.calls if c.name == "all_reduce"][-1]
    return sent, rec_call.counts.msgs_sent, rec_call.counts.bytes_sent


def record() -> list:
    res = spawn(_record, N, timeout=120)
    for r, (sent, msgs, nbytes) in enumerate(res):
        assert len(sent) == msgs == 2 * (N - 1), (r, len(sent), msgs)
        assert all(c is not None for _, _, c in sent), (r, sent)       # every message is a chunk of x
        assert nbytes == 2 * (N - 1) * NUMEL * 4 // N, (r, nbytes)
    return [sent for sent, _, _ in res]


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
