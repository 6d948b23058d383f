"""algorithm="shm": the textbook's shared-memory collectives (primitives/shm.py) on this host's
segment: the flags they publish and wait for, the check in the workspace header, their bytes
in the ledger. Only when every rank of the group is on this host (ShmComm.transport == "shm");
`auto` picks them by cost.py. No messages, no barrier object, no allocation per call.

    RINGZERO_TRANSPORT=shm torchrun --nproc_per_node 4 benchmarks/collectives.py --ops all_reduce --algorithms shm
    python -m pytest -q tests/test_shm_collectives.py -k check

Each rank owns BUFS = 3 workspaces of W bytes (RINGZERO_SHM_WORKSPACE, 2 MiB: a round's working
set stays in cache; benchmarks/shm_profile.py measured the copies and adds of 64 MiB ~4x faster
in 2 MiB rounds than in 16 MiB ones). The ledger counts what peers read of mine: one-shot
(N-1)·S, by slices 2(N-1)/N·S (what "direct" sends), all-gather / reduce-scatter (N-1)·s.

Each rank has a publish counter in its control line (shm_segment.SEQ_OFF). Publishing = bump
mine after writing the data (x86-64 keeps stores in order); waiting = until every peer's
counter reached mine: _State.wait polls the counters (up to shm_segment.max_polls: 2000 while
every rank has a core, none when ranks outnumber cores; halved after a wait that slept, doubled
after one that ended soon after), then ShmComm.spin_until (shm.py): 32 polls more (2 when
oversubscribed), sched_yield() for shm_segment.yield_s (0.5 ms when ranks outnumber cores, else
0), then a futex on my doorbell, which a publisher bumps always and rings (a system call) only
when I said I sleep.
Cost per flag: one store per peer, a system call per sleeping peer, one wake-up when I slept.

The check (core.run -> checked()): the call's fingerprint (check.py) and this rank's argument
errors ride in the header of the first workspace a call publishes, in the envelope's layout
(envelope.py: MAGIC, the 8 words, the error text's length, then the text); after the first
wait every rank compares every header (envelope.verdict), so a disagreement raises
CollectiveError on every rank without a round of its own. A call that publishes no data (bad
arguments, empty tensor) publishes the header alone. If a peer is in a message-based call
instead (its check envelope, envelope.py, is waiting in my channel and it never raised its
flag), I withdraw my flag and meet its envelope round with my fingerprint: both sides raise.
"""
from __future__ import annotations

import numpy as np

from primitives import shm
from primitives.engine import shm_segment as seg
from primitives.engine.envelope import ERR, MAGIC, check_round, verdict
from primitives.engine.errors import CollectiveError
from primitives.engine.ledger import LEDGER
from primitives.engine.shm_segment import BUFS, HDR_BYTES, LINE, SEQ_OFF, SLEEP_OFF, SPIN, WS_BYTES
from primitives.ops import chunk_bounds

ONE_SHOT_BYTES = min(WS_BYTES, shm.ONE_SHOT_BYTES)
ONE_SHOT_BYTES_2 = WS_BYTES   # two ranks: one shot up to a workspace (shm.py: the same 2S written, 1 flag not 2)


def one_shot(nbytes: int, n: int) -> bool:
    """Whether an all-reduce of nbytes over n ranks runs shm_one_shot (else shm_reduce_by_slices)."""
    return nbytes <= (ONE_SHOT_BYTES_2 if n == 2 else ONE_SHOT_BYTES)


class Stamp:
    """A call's check as it rides in a workspace header (envelope.py's layout): `head`, the bytes
    MAGIC, the 8 fingerprint words, the error text's length; then the text. A plan builds its
    Stamp once; a peer whose header holds the same `head` agrees (no errors, same call)."""
    __slots__ = ("name", "meta", "errors", "head", "text")

    def __init__(self, name: str, meta: list[int], errors: list[str]):
        self.name, self.meta, self.errors = name, meta, errors
        self.text = "; ".join(errors).encode()[:HDR_BYTES - 8 * (ERR + 1)]
        self.head = np.array([MAGIC, *meta, len(self.text)], dtype=np.int64).tobytes()


class _State:
    """One communicator's segment as primitives/shm.py reads it: counters, flag addresses and
    workspace views, built once. `what` names the call in a timeout's message. The flags are
    read and written through memoryviews of the segment (q: int64, l: int32, b: bytes): an
    item costs ~20 ns there, ~70 ns through numpy."""

    def __init__(self, comm):
        L, n, me = comm.L, comm.size, comm.rank
        line = lambda r: L["ctl"] + comm.local[r] * LINE  # noqa: E731
        self.comm, self.rank, self.size, self.what = comm, me, n, "shm collective"
        whole = memoryview(comm.mm)
        self.q, self.l, self.b = whole.cast("q"), whole.cast("i"), whole
        self.seq = self.q[(line(me) + SEQ_OFF) // 8]
        self.gen, self.fp = 0, None
        self.me_seq = (line(me) + SEQ_OFF) // 8
        self.peers = [p for p in range(n) if p != me]
        self.peer_seq = [(p, (line(p) + SEQ_OFF) // 8) for p in self.peers]
        self.peer_idx = [i for _, i in self.peer_seq]
        self.peer_wake = [((line(p) + SLEEP_OFF) // 4, comm._door(p) // 4) for p in self.peers]
        self.W = W = seg.WS_BYTES                   # the segment's; self.W may be set smaller (tests)
        self.ws = [[comm.u8[L["ws"] + (r * BUFS + b) * W:][:W] for b in range(BUFS)] for r in range(n)]
        self.hoff = [[L["hdr"] + (r * BUFS + b) * HDR_BYTES for b in range(BUFS)] for r in range(n)]
        self.hdr = [[comm.i64[o // 8:][:HDR_BYTES // 8] for o in offs] for offs in self.hoff]
        self.views, self.max_polls = {}, seg.max_polls(comm.n_local)
        self.stamped = [None] * BUFS                  # the Stamp each of my headers holds
        self.polls = self.max_polls

    def view(self, r: int, b: int, dtype, i: int = 0, j: int | None = None) -> torch.Tensor:
        """Cached: a torch slice costs µs, and a step repeats the same few views every call."""
        key = (r, b, dtype, i, j)
        v = self.views.get(key)
        if v is None:
            if len(self.views) > 4096:
                self.views.clear()
            v = self.views[key] = self.ws[r][b].view(dtype)[i:j]
        return v

    def items(self, r: int, b: int, fmt: str) -> memoryview:
        """Rank r's workspace b as a memoryview of items (a small call's: primitives/shm.py), cached."""
        v = self.views.get((r, b, fmt))
        if v is None:
            o = self.comm.L["ws"] + (r * BUFS + b) * seg.WS_BYTES
            v = self.views[(r, b, fmt)] = self.b[o:o + seg.WS_BYTES].cast(fmt)
        return v

    def next_buf(self, k: int = 1) -> int:
        b = self.gen % BUFS
        self.gen += k
        return b

    def publish(self, b: int | None = None) -> None:
        """Raise my counter; b: the first buffer of a call, whose header carries the Stamp (written
        unless that header holds it already: a replayed plan's Stamp is one object)."""
        fp = self.fp
        if b is not None and fp is not None and self.stamped[b] is not fp:
            o = self.hoff[self.rank][b]
            k = o + len(fp.head)
            self.b[o:k] = fp.head
            if fp.text:
                self.b[k:k + len(fp.text)] = fp.text
            self.stamped[b] = fp
        self.seq += 1
        self.q[self.me_seq] = self.seq                # after the data (x86-64: stores stay in order)
        l32 = self.l
        for sleep, door in self.peer_wake:
            l32[door] += 1                            # a peer about to sleep sees the bell moved
            if l32[sleep]:
                seg.futex_wake(self.comm._base + 4 * door)

    def wait(self, b: int | None = None) -> None:
        """Until every peer published as often as I did: self.polls quick polls, then ShmComm.spin_until.
        b: this is a call's first wait (check the headers of buffer b; a peer's check envelope
        in my channel means it is in another call)."""
        q, k = self.q, self.seq
        for _ in range(self.polls):
            for i in self.peer_idx:
                if q[i] < k:
                    break
            else:
                break
        else:          # adapt: poll longer when the peer came soon after, less when I had to sleep
            if self._wait_long(b):
                self.polls = min(self.max_polls, 2 * self.polls + 64)
            elif seg.POLLS is None:
                self.polls //= 2
        fp = self.fp
        if b is not None and fp is not None:
            self.fp = None
            n, mm = len(fp.head), self.comm.mm
            for p in self.peers:
                o = self.hoff[p][b]
                if mm[o:o + n] != fp.head or fp.errors:
                    _verify(self.comm, self, b, fp)

    def _wait_long(self, b: int | None) -> bool:
        """ShmComm.spin_until; whether it ended within its polls (the peer was close)."""
        comm, k, q, polls = self.comm, self.seq, self.q, 0
        pend = [(p, i) for p, i in self.peer_seq if q[i] < k]

        def ready() -> bool:
            nonlocal pend, polls
            polls += 1
            # a peer in another call never publishes: look for its envelope once polling is not enough,
            # every 16th poll (~2 µs each: with ranks sharing a core, every poll delays the peer)
            stray = (_stray(comm, pend) if polls >= SPIN and not polls % 16 and b is not None and self.fp is not None
                     else None)
            pend = [(p, i) for p, i in pend if q[i] < k]
            if pend and stray is not None:
                _answer(comm, self)
            return not pend
        return not pend or comm.spin_until(ready, lambda: pend[0][0], f"{self.what}: waiting for")


def state(comm) -> _State:
    st = comm.__dict__.get("_shm_state")
    if st is None:
        st = comm._shm_state = _State(comm)
    return st


def _verify(comm, st, b: int, fp: Stamp) -> None:
    hdr = [st.hdr[p][b] for p in st.peers]
    problem = verdict(comm, fp.name, [MAGIC, *fp.meta, len(fp.errors)], fp.errors, st.peers,
                      [h[:ERR + 1].tolist() for h in hdr], lambda i, k: hdr[i][ERR + 1:].view(np.uint8)[:k].tobytes())
    if problem is not None:
        raise CollectiveError(problem)


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
    fp, st.fp = st.fp, None
    st.seq -= 1
    st.gen -= 1
    st.q[st.me_seq] = st.seq
    check_round(comm, fp.name, fp.meta, fp.errors, None)
    raise CollectiveError(f"rank {comm.rank}: {fp.name}: a peer is in a message-based call, this rank in algorithm 'shm'")


def checked(comm, name: str, meta: list[int], errors: list[str], body) -> None:
    """core.run's check for algorithm="shm": body() publishes the fingerprint with its data;
    a call that published nothing (bad arguments, an empty tensor) publishes it alone."""
    st = state(comm)
    st.fp, st.what = Stamp(name, meta, errors), name
    try:
        if not errors:
            body()
        if st.fp is not None:
            b = st.next_buf()
            st.publish(b)
            st.wait(b)
    finally:
        st.fp = None


def _count(sent: list[int], recv: list[int]) -> None:
    for b in sent:
        if b:
            LEDGER.sent(b)
    for b in recv:
        if b:
            LEDGER.received(b)


def all_reduce(comm, buf, op):
    st = state(comm)
    n, r, S = comm.size, comm.rank, buf.numel() * buf.element_size()
    if one_shot(S, n):                            # fits the real workspace (st.W may be set smaller)
        shm.shm_one_shot(st, buf, op)
        return _count([S] * (n - 1), [S] * (n - 1))
    shm.shm_reduce_by_slices(st, buf, op)
    c = [(e - s) * buf.element_size() for s, e in chunk_bounds(buf.numel(), n)]
    _count([c[p] for p in st.peers] + [c[r]] * (n - 1), [c[r]] * (n - 1) + [c[p] for p in st.peers])


def all_gather(comm, blocks):
    shm.shm_all_gather(state(comm), blocks)
    S = blocks[comm.rank].numel() * blocks[comm.rank].element_size()
    _count([S] * (comm.size - 1), [S] * (comm.size - 1))


def reduce_scatter(comm, blocks, out, op):
    shm.shm_reduce_scatter(state(comm), blocks, out, op)
    S = out.numel() * out.element_size()
    _count([S] * (comm.size - 1), [S] * (comm.size - 1))
