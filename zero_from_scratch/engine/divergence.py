"""ZeRO-3 divergence: ranks that ran different modules raise an error naming them, never hang.

    python -m pytest tests/test_zero_stage3.py -k diverg

Every ZeRO-3 collective carries (kind, unit, call#) as its identity. With the primitives
handshake on, the identity rides along as the collective's `tag` (checked in the handshake round
the collective does anyway: no extra latency) and is spelled out, by `diverged`, only once the
handshake has flagged a mismatch on every rank. Otherwise (handshake off, or comm_impl="torch")
it costs one all-gather of 3 int64 before each collective. A module run a different number of
times, or in a different order, on some rank then raises ZeroDivergenceError on every rank
(DeepSpeed #7998 hangs instead).
"""
from __future__ import annotations

import contextlib

from primitives import CollectiveError

KINDS = {"forward": 1, "backward": 2, "reduce": 3, "gather_ctx": 4}


class ZeroDivergenceError(RuntimeError):
    """Ranks ran different modules (or a module a different number of times)."""


class DivergenceCheck:
    """comm: the engine's Comm; tag_of: unit index -> module name (for the message)."""

    def __init__(self, comm, tag_of: dict):
        self.comm, self.tag_of = comm, tag_of
        self.calls: dict[int, int] = {}

    def restart(self) -> None:
        self.calls.clear()             # every micro-batch, the same on every rank

    def count(self, kind: str, u, label: str) -> int:
        """Count this (kind, unit) call and make sure every rank is at the same one; returns the
        tag for the collective (0: checked here already, or one rank)."""
        c = self.comm
        if c.size == 1:
            return 0
        n = self.calls[u.index] = self.calls.get(u.index, 0) + 1
        mine = [KINDS[kind], u.index, n]
        if c.checks_tags:
            return (mine[0] << 48) | (mine[1] << 24) | mine[2]
        self.diverged(c.gather_ints(mine), label)
        return 0

    def diverged(self, rows, label: str) -> None:
        c = self.comm
        if any(r != rows[c.rank] for r in rows):
            def say(r):
                k = {v: key for key, v in KINDS.items()}.get(r[0], "?")
                return f"{k} of module {self.tag_of.get(r[1], '?')!r} (call #{r[2]})"
            desc = "; ".join(f"rank {i}: {say(r)}" for i, r in enumerate(rows))
            raise ZeroDivergenceError(
                f"rank {c.rank}: ZeRO-3 ranks diverged at {label}: {desc}. Every rank must run the same "
                "modules, the same number of times, in the same order (same control flow on every rank)")

    @contextlib.contextmanager
    def tagged(self, tag: int, label: str):
        """Turn a handshake mismatch of the tagged collective into a ZeroDivergenceError that names
        the modules. Every rank sees the mismatch, so every rank can take part in gather_ints."""
        try:
            yield
        except CollectiveError as e:
            if not tag:
                raise
            self.diverged(self.comm.gather_ints([tag >> 48, (tag >> 24) & 0xFFFFFF, tag & 0xFFFFFF]), label)
            raise ZeroDivergenceError(f"rank {self.comm.rank}: ZeRO-3 collective failed at {label}: {e}") from e
