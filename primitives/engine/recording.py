"""A recording Communicator: every message an algorithm posts, in order, for pictures and tests.

    rec = Recording(get_comm())                       # a view of the same ranks
    primitives.all_reduce(x, group=rec, algorithm="ring")
    rec.log  -> [Message(kind="send", peer=1, tensor=<view>, nbytes=..., control=False), ...]

It records at the Communicator's own interface (isend / irecv / exchange: what every textbook
algorithm and the check round talk through), so it sees the same messages on every transport
and whatever the transport does underneath. Messages the ledger counted as control traffic (the
check round's envelopes) are marked control. Cost: one list entry per message.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from primitives.engine.ledger import LEDGER
from primitives.engine.subcomm import SubComm


@dataclass
class Message:
    kind: str                  # "send" | "recv"
    peer: int                  # group rank
    tensor: torch.Tensor       # the buffer posted (a view of the caller's tensor, or a scratch buffer)
    nbytes: int
    control: bool              # part of the check round (its fixed-size envelopes), not the algorithm's data


class Recording(SubComm):
    """A view of `parent` with all of its ranks that logs every posted message."""

    def __init__(self, parent):
        super().__init__(parent, list(range(parent.size)))
        self.log: list[Message] = []

    def _posted(self, ops, post):
        """Post, then log ops [(kind, tensor, peer)]: control if the ledger counted them as such."""
        before = LEDGER.control.msgs_sent + LEDGER.control.msgs_recv
        out = post()
        control = LEDGER.control.msgs_sent + LEDGER.control.msgs_recv > before
        self.log += [Message(k, p, t, t.numel() * t.element_size(), control) for k, t, p in ops if t.numel()]
        return out

    def isend(self, tensor, peer):
        return self._posted([("send", tensor, peer)], lambda: super(Recording, self).isend(tensor, peer))

    def irecv(self, tensor, peer):
        return self._posted([("recv", tensor, peer)], lambda: super(Recording, self).irecv(tensor, peer))

    def exchange(self, sends=(), recvs=()):
        ops = [("recv", t, p) for t, p in recvs] + [("send", t, p) for t, p in sends]
        return self._posted(ops, lambda: super(Recording, self).exchange(sends, recvs))

    def sends(self, data_only: bool = True) -> list[Message]:
        return [m for m in self.log if m.kind == "send" and not (data_only and m.control)]

