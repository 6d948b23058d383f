"""Flags instead of messages: how the shm collectives (shm_collectives.py) publish, wait, and
carry the call's check. No messages, no barrier object, no allocation per call.

    python -m pytest -q tests/test_shm_collectives.py -k check

Each rank has a publish counter in its control line (shm_segment.SEQ_OFF). Publishing = bump
mine after writing the data (x86-64 keeps stores in order); waiting = until every peer's
counter reached mine: a few polls, sched_yield() between polls for RINGZERO_SHM_YIELD_S
(default 0: on an oversubscribed host a polling rank holds the core its peer needs; what
MPIR_CVAR_ENABLE_HEAVY_YIELD does for MPICH), then a futex on my
doorbell, which a publisher bumps always and rings (a system call) only when I said I sleep.
Cost per flag: one store per peer, a system call per sleeping peer, one wake-up when I slept.

The check (core.run -> checked()): the call's fingerprint (check.py) and this rank's argument
errors ride in the header of the first workspace a call publishes; after the first wait
every rank compares every header, so a disagreement raises CollectiveError on every rank
without a round of its own. A call that publishes no data (bad arguments, empty tensor)
publishes the header alone. If a peer is in a message-based call instead (its check
envelope, envelope.py, is waiting in my channel and it never raised its flag), I withdraw my
flag and meet its envelope round with my fingerprint: both sides raise.
"""
from __future__ import annotations

import os
import time

import numpy as np

from primitives.engine import shm_segment as seg
from primitives.engine.check import META_DESC
from primitives.engine.envelope import MAGIC, check_round
from primitives.engine.errors import CollectiveError
from primitives.engine.shm_segment import BUFS, HDR_BYTES, LINE, SEQ_OFF, SLEEP_OFF, SPIN, YIELD_S

NMETA = 8                                   # core.run's fingerprint: call, algorithm, op, root, dtype, numel, shape, tag


class _State:
    """One communicator's segment as primitives/shm.py reads it: counters, flag addresses and
    workspace views, built once. `what` names the call in a timeout's message."""

    def __init__(self, comm):
        L, n, me = comm.L, comm.size, comm.rank
        line = lambda r: L["ctl"] + comm.local[r] * LINE  # noqa: E731
        self.comm, self.rank, self.size, self.what = comm, me, n, "shm collective"
        self.seq = int(comm.i64[(line(me) + SEQ_OFF) // 8])
        self.gen, self.fp = 0, None
        self.me_seq, self.me_sleep = (line(me) + SEQ_OFF) // 8, (line(me) + SLEEP_OFF) // 4
        self.me_door = comm._door(me) // 4
        self.peers = [p for p in range(n) if p != me]
        self.peer_seq = [(p, (line(p) + SEQ_OFF) // 8) for p in self.peers]
        self.peer_wake = [((line(p) + SLEEP_OFF) // 4, comm._door(p) // 4) for p in self.peers]
        self.W = W = seg.WS_BYTES                   # the segment's; self.W may be set smaller (tests)
        self.ws = [[comm.u8[L["ws"] + (r * BUFS + b) * W:][:W] for b in range(BUFS)] for r in range(n)]
        self.hdr = [[comm.i64[(L["hdr"] + (r * BUFS + b) * HDR_BYTES) // 8:][:HDR_BYTES // 8] for b in range(BUFS)]
                    for r in range(n)]
        self.views = {}

    def view(self, r: int, b: int, dtype, i: int = 0, j: int | None = None) -> torch.Tensor:
        """Cached: a torch slice costs µs, and a step repeats the same few views every call."""
        key = (r, b, dtype, i, j)
        v = self.views.get(key)
        if v is None:
            if len(self.views) > 4096:
                self.views.clear()
            v = self.views[key] = self.ws[r][b].view(dtype)[i:j]
        return v

    def next_buf(self, k: int = 1) -> int:
        b = self.gen % BUFS
        self.gen += k
        return b

    def publish(self, b: int | None = None) -> None:
        """Raise my counter; b: the first buffer of a call, whose header carries the fingerprint."""
        comm = self.comm
        if b is not None and self.fp is not None:
            _, meta, errors = self.fp
            text = "; ".join(errors).encode()[:HDR_BYTES - 8 * (NMETA + 1)]
            h = self.hdr[self.rank][b]
            h[:NMETA] = meta
            h[NMETA] = len(text)
            if text:
                h[NMETA + 1:].view(np.uint8)[:len(text)] = np.frombuffer(text, dtype=np.uint8)
        self.seq += 1
        i64, i32 = comm.i64, comm.i32
        i64[self.me_seq] = self.seq                   # after the data (x86-64: stores stay in order)
        for sleep, door in self.peer_wake:
            i32[door] += 1                            # a peer about to sleep sees the bell moved
            if i32[sleep]:
                seg.futex_wake(comm._base + 4 * door)

    def wait(self, b: int | None = None) -> None:
        """Until every peer published as often as I did. b: this is a call's first wait (check the
        headers of buffer b; a peer's check envelope in my channel means it is in another call)."""
        comm, st = self.comm, self
        k, i64, i32 = st.seq, comm.i64, comm.i32
        pend = [(p, i) for p, i in st.peer_seq if i64[i] < k]
        spins, start, check, spin_until = 0, None, 0.0, None
        try:
            while pend:
                bell = int(i32[st.me_door])
                # a peer in another call never publishes: look for its envelope once polling is not enough
                stray = _stray(comm, pend) if spins >= SPIN - 1 and b is not None and st.fp is not None else None
                pend = [(p, i) for p, i in pend if i64[i] < k]
                if not pend:
                    break
                if stray is not None:
                    _answer(comm, st)
                spins += 1
                if spins < SPIN:
                    continue
                now = time.monotonic()
                if spin_until is None:
                    spin_until = now + YIELD_S
                if now < spin_until:
                    os.sched_yield()
                    continue
                if start is None:
                    start, check = now, now + 0.05          # liveness: /proc reads cost ~1 ms under load
                    i32[st.me_sleep] = 1
                    continue                                # re-check once after saying I sleep
                if now >= check:
                    comm._check_peers(pend[0][0], f"{self.what}: waiting for")
                    check = now + 0.05
                if now - start > comm.timeout:
                    raise comm._peer_error(pend[0][0], f"{self.what}: waiting for", RuntimeError(
                        f"timed out after {comm.timeout:.0f}s on the shared-memory transport"))
                seg.futex_wait(comm._base + 4 * st.me_door, bell, 5e-3)
        finally:
            i32[st.me_sleep] = 0
        if b is not None and st.fp is not None:
            _verify(comm, st, b)


def state(comm) -> _State:
    st = comm.__dict__.get("_shm_state")
    if st is None:
        st = comm._shm_state = _State(comm)
    return st


def _verify(comm, st, b: int) -> None:
    name, meta, errors = st.fp
    st.fp = None
    me = comm.rank
    if errors:
        raise CollectiveError(f"rank {me}: {name}: " + "; ".join(errors))
    heads = {p: st.hdr[p][b][:NMETA + 1].tolist() for p in st.peers}
    bad = [p for p in st.peers if heads[p][NMETA]]
    if bad:
        why = "; ".join(f"rank {p}: " + st.hdr[p][b][NMETA + 1:].view(np.uint8)[:heads[p][NMETA]].tobytes()
                        .decode(errors="replace") for p in bad)
        raise CollectiveError(f"rank {me}: {name} aborted because rank(s) {bad} passed invalid arguments: {why}")
    for p in st.peers:
        if heads[p][:NMETA] != list(meta):
            raise CollectiveError(f"rank {me}: {name}: ranks disagree on the call: rank {me} passed "
                                  f"{META_DESC(list(meta))} but rank {p} passed {META_DESC(heads[p][:NMETA])}")


def _stray(comm, pend):
    """A pending peer whose next message to me (none posted for) opens with a check envelope."""
    for p, _ in pend:
        if comm._recvq.get(p):
            continue
        ch = comm._chan(p, comm.rank)
        tail = comm._tail[p]
        if int(comm.i64[ch // 8]) > tail:
            s = comm._slot(ch, tail)
            if int(comm.i64[(s + LINE) // 8]) == MAGIC:
                return p
    return None


def _answer(comm, st) -> None:
    """Withdraw my first flag (nobody passed it: the stray peer never raised its own) and meet
    the peer's envelope round with my fingerprint: every rank raises the disagreement."""
    name, meta, errors = st.fp
    st.fp = None
    st.seq -= 1
    st.gen -= 1
    comm.i64[st.me_seq] = st.seq
    check_round(comm, name, meta, errors, META_DESC, None, CollectiveError)
    raise CollectiveError(f"rank {comm.rank}: {name}: a peer is in a message-based call, this rank in algorithm 'shm'")


def checked(comm, name: str, meta: list[int], errors: list[str], body) -> None:
    """core.run's check for algorithm="shm": body() publishes the fingerprint with its data;
    a call that published nothing (bad arguments, an empty tensor) publishes it alone."""
    st = state(comm)
    st.fp, st.what = (name, meta, errors), name
    try:
        if not errors:
            body()
        if st.fp is not None:
            b = st.next_buf()
            st.publish(b)
            st.wait(b)
    finally:
        st.fp = None

