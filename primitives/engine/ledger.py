"""Counts every point-to-point message this process sends and receives.

The ledger is what lets a test say "ring all-reduce sent exactly 2(N-1) messages and
2(N-1)/N·S bytes" instead of trusting a docstring. Communicator.isend/irecv record into it;
each collective call opens a CallRecord so counts are also available per call. A replayed call
(core.Replay) counts no message: its record is the one its signature's first replay counted
(the same algorithm on the same sizes sends the same messages), added once at its end.

Data traffic (the algorithm's own messages) is kept apart from control traffic (the small
metadata handshake that turns mismatched arguments into errors), so formulas compare
against data alone.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field


@dataclass
class Counts:
    msgs_sent: int = 0
    bytes_sent: int = 0
    msgs_recv: int = 0
    bytes_recv: int = 0

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(self.msgs_sent - other.msgs_sent, self.bytes_sent - other.bytes_sent,
                      self.msgs_recv - other.msgs_recv, self.bytes_recv - other.bytes_recv)

    def __iadd__(self, o: "Counts") -> "Counts":
        self.msgs_sent, self.bytes_sent = self.msgs_sent + o.msgs_sent, self.bytes_sent + o.bytes_sent
        self.msgs_recv, self.bytes_recv = self.msgs_recv + o.msgs_recv, self.bytes_recv + o.bytes_recv
        return self

    def copy(self) -> "Counts":
        return Counts(self.msgs_sent, self.bytes_sent, self.msgs_recv, self.bytes_recv)


@dataclass
class CallRecord:
    """One collective call: its name, the algorithm that ran, and the data traffic it caused."""
    name: str
    algorithm: str
    nbytes: int                      # S: the full buffer, as nccl-tests counts it
    counts: Counts = field(default_factory=Counts)
    links: dict = field(default_factory=dict)   # multinode: "intra"/"inter" -> Counts (primitives/engine/topology.py)
    template: "CallRecord | None" = None       # a replayed call: the record to add instead of counting


class _PerThread(threading.local):
    # async collectives of different communicators run on different worker threads: the
    # call being recorded, and whether we are inside a handshake, belong to the thread
    current: "CallRecord | None" = None
    control_depth: int = 0


class Ledger:
    def __init__(self):
        self.data = Counts()         # all data messages since the last reset
        self.control = Counts()      # handshake messages
        self.calls: list[CallRecord] = []
        self.links: dict[str, Counts] = {}   # data traffic per link class ("intra"/"inter" node)
        self._t = _PerThread()
        self._lock = threading.Lock()
        self.keep_calls = True       # benchmarks turn this off to avoid growing a list

    def reset(self) -> None:
        self.data, self.control, self.calls, self.links = Counts(), Counts(), [], {}

    def _target(self) -> list[Counts]:
        if self._t.control_depth:
            return [self.control]
        return [self.data] + ([self._t.current.counts] if self._t.current else [])

    def _link_targets(self, link: str | None) -> list[Counts]:
        # multinode: data messages are also counted per link class (intra- / inter-node)
        if link is None or self._t.control_depth:
            return []
        out = [self.links.setdefault(link, Counts())]
        if self._t.current is not None:
            out.append(self._t.current.links.setdefault(link, Counts()))
        return out

    def in_control(self) -> bool:
        return bool(self._t.control_depth)

    def _replaying(self) -> bool:
        cur = self._t.current
        return cur is not None and cur.template is not None and not self._t.control_depth

    def _count(self, nbytes: int, link: str | None, out: bool) -> None:
        """One message of nbytes, sent (out) or received, on link class `link` (None: not known)."""
        with self._lock:
            for c in self._target() + self._link_targets(link):
                if out:
                    c.msgs_sent += 1
                    c.bytes_sent += nbytes
                else:
                    c.msgs_recv += 1
                    c.bytes_recv += nbytes

    def sent(self, nbytes: int, link: str | None = None) -> None:
        if not self._replaying():
            self._count(nbytes, link, True)

    def received(self, nbytes: int, link: str | None = None) -> None:
        if not self._replaying():
            self._count(nbytes, link, False)

    def data_moved(self, sent: list[int], received: list[int], links: list[str | None] | None = None) -> None:
        """Data that rode in control messages (the fused check's envelopes): one message per
        non-zero entry, counted as data without counting the envelope twice as control.
        links[i]: the link class ("intra"/"inter") of the peer of sent[i] and received[i]. The
        fused path counts per link like sent()/received(), or small calls vanish from self.links."""
        if self._t.control_depth or self._replaying():   # a call the caller marked as control (e.g. a
            return                  # status all-reduce): its envelopes, payload inside, were counted as control
        links = links if links is not None else [None] * max(len(sent), len(received))
        for entries, out in ((sent, True), (received, False)):
            for b, link in zip(entries, links):
                if b:
                    self._count(b, link, out)

    def _add(self, rec: CallRecord) -> None:
        """A replayed call's counts (its template's, shared) added to the totals; lock held."""
        self.data += rec.counts
        self._add_links(rec)

    def _add_links(self, rec: CallRecord) -> None:
        for k, c in rec.links.items():
            total = self.links.setdefault(k, Counts())
            total += c

    def open_call(self, name: str, algorithm: str, nbytes: int, template: CallRecord | None = None) -> tuple:
        """Start counting a collective call (close_call ends it; call() is the same as a `with`).
        template: a replayed call's record, added by close_call(ok=True) instead of counting."""
        rec = CallRecord(name, algorithm, nbytes, template=template)
        prev, self._t.current = self._t.current, rec
        return rec, prev

    def close_call(self, rec: CallRecord, prev, ok: bool = True) -> None:
        self._t.current = prev
        t = rec.template
        if t is not None and ok and not self._t.control_depth:   # a call marked as control adds no data
            rec.counts, rec.links = t.counts, t.links     # shared: nothing counts into a replayed record
            if t.counts.msgs_sent or t.counts.msgs_recv:
                with self._lock:
                    self._add(rec)
        if self.keep_calls and prev is None:
            with self._lock:
                self.calls.append(rec)

    def add_replayed(self, rec: CallRecord) -> None:
        """A planned call's end (planned.py): its record (shared counts, template set) added to
        the totals, as close_call adds a replayed record, with no call open around it."""
        with self._lock:                          # _add, inlined: a replay of a few floats costs µs in all
            c, d = rec.counts, self.data
            d.msgs_sent, d.bytes_sent = d.msgs_sent + c.msgs_sent, d.bytes_sent + c.bytes_sent
            d.msgs_recv, d.bytes_recv = d.msgs_recv + c.msgs_recv, d.bytes_recv + c.bytes_recv
            if rec.links:
                self._add_links(rec)
            if self.keep_calls:
                self.calls.append(rec)

    @contextlib.contextmanager
    def call(self, name: str, algorithm: str, nbytes: int):
        rec, prev = self.open_call(name, algorithm, nbytes)
        try:
            yield rec
        finally:
            self.close_call(rec, prev)

    @contextlib.contextmanager
    def control_traffic(self):
        self._t.control_depth += 1
        try:
            yield
        finally:
            self._t.control_depth -= 1

    @contextlib.contextmanager
    def track(self):
        """`with LEDGER.track() as delta:` ... afterwards `delta` holds the data traffic inside."""
        start = self.data.copy()
        delta = Counts()
        try:
            yield delta
        finally:
            d = self.data - start
            delta.msgs_sent, delta.bytes_sent = d.msgs_sent, d.bytes_sent
            delta.msgs_recv, delta.bytes_recv = d.msgs_recv, d.bytes_recv


LEDGER = Ledger()   # one per process: every communicator records here
