"""The check rides in the data: the call's fingerprint travels with the algorithm's first messages.

    python -m pytest -q -x tests/test_check_in_data.py tests/test_primitives_errors.py
    torchrun --standalone --nproc_per_node 4 benchmarks/collectives.py --ops all_reduce   ("check cost")

The checked call (core.run) hands the algorithm a communicator whose first posting of the call
does three things at once, with no wait in between:
  1. it sends every peer an envelope: a HEADER_BYTES fingerprint (envelope.HEAD: call, algorithm,
     op, root, dtype, numel, shape hash, tag, my error text's length, `inline`, `follow`) and,
     when the algorithm's first message to that peer is ≤ INLINE bytes, that message itself
     (`inline` = its size). Envelopes go to ALL N-1 peers, so every rank learns every fingerprint,
     also from ranks the algorithm never talks to;
  2. a first message bigger than INLINE is sent right behind its envelope (`follow` = its size);
  3. it posts a receive of ENVELOPE_BYTES from every peer. Receiving fewer bytes than posted is
     safe on gloo (more would abort the process) and on the shm transport (an "up to" receive).
The algorithm's receives (and any other send of that posting) wait, as requests, until every
envelope is in and checked: from then on every message has a size both sides agree on. The
algorithm's later postings go through unchanged. So a checked call costs no round of its own:
the envelopes travel with the first step's data, and what waits for them is only the first
step's receives (one envelope latency; a small first message comes inside its envelope).

A mismatch, or bad arguments on any rank (whose envelope then carries its error text and no
data), is seen by EVERY rank in its own copy of the N fingerprints, before any receive of a
disagreeing size is posted or any message left in flight: each rank first receives, into a
scratch buffer, the `follow` messages announced to it (exact sizes, from the headers) and waits
for its own sends, then raises CollectiveError naming the ranks and what differed. The
communicator is usable afterwards. Ranks whose algorithm posts nothing still send and check
their envelopes at the end of the call (core.run).

    cost per rank: N-1 envelopes of HEADER_BYTES (+ the first message, if ≤ INLINE), posted with
    the first step; the first step's receives wait ≈ one latency α for them; no extra round.

Not used (envelope.check_round is, a separate round before the algorithm): on CUDA (the verdict
is computed on the device, envelope.py), in strict nccl ordering (a tested, conservative order),
for algorithm="shm" (no point-to-point messages to ride on) and "hierarchical" (its messages go
through views of the communicator, subcomm.py).
"""
from __future__ import annotations

import torch

from primitives.comm import DONE, Work
from primitives.engine.algos import ENVELOPE_BYTES, ENVELOPE_PAYLOAD, HEADER_BYTES
from primitives.engine.envelope import (ERR, FOLLOW, INLINE_AT, MAGIC, NH, count_fused, drain, envelope_text,
                                        envelopes, verdict)
from primitives.engine.errors import CollectiveError
from primitives.engine.ledger import LEDGER

INLINE = ENVELOPE_PAYLOAD        # a first message up to this size rides inside its envelope


def applies(comm, algo: str) -> bool:
    """Does this call check in the data (else: envelope.check_round, a round of its own)?"""
    return (comm.device.type == "cpu" and not getattr(comm, "strict", False)
            and algo not in ("shm", "hierarchical") and not hasattr(comm, "parent"))


class _Later:
    """A Work's handle for an operation of the first posting that waits for the verdict: wait()
    settles the call first."""
    __slots__ = ("ib", "kind", "t", "peer", "req")
    waits_itself = True

    def __init__(self, ib, kind, t, peer):
        self.ib, self.kind, self.t, self.peer, self.req = ib, kind, t, peer, None

    def wait(self, timeout=None) -> bool:
        self.ib.settle()
        if self.req is not None:
            self.req.wait()
        return True

    def is_completed(self) -> bool:
        return self.req is not None and self.req.is_completed()


class InBand:
    """One checked call's state while its algorithm runs (comm._inband)."""

    def __init__(self, comm, name, meta, errors):
        n, me = comm.size, comm.rank
        self.comm, self.name, self.meta, self.errors = comm, name, meta, errors
        self.peers = [(me + i) % n for i in range(1, n)]
        self.opened = self.settled = False
        self.failed = None
        self.later, self.mine, self.env_in = [], [], []
        self.sent_inline, self.got = [0] * (n - 1), [0] * (n - 1)
        self.inline_left, self.heads = {}, None    # peer -> envelope row whose message is still to take

    # ---- the first posting: envelopes out and in, big first messages right behind them
    def post(self, ops):
        """Requests for ops (("recv"|"send", tensor, peer), as exchange orders them), or None
        when the call is past its first posting (then the caller posts them as usual)."""
        if not self.opened:
            return self.open(ops)
        self.settle()
        if not any(k == "recv" and p in self.inline_left for k, _, p in ops):
            return None
        out, rest = [DONE] * len(ops), []
        for j, (k, t, p) in enumerate(ops):
            if k == "recv" and p in self.inline_left:
                self._fill(t, p)
            else:
                rest.append(j)
        for j, r in zip(rest, self.comm._post_raw([ops[j] for j in rest])):
            out[j] = r
        return out

    def _fill(self, t, p) -> None:
        """My first receive from p takes p's first message, which came inside p's envelope."""
        i = self.inline_left.pop(p)
        nb = t.numel() * t.element_size()
        if nb != self.heads[i][INLINE_AT]:      # cannot happen once the fingerprints agree
            raise CollectiveError(f"rank {self.comm.rank}: {self.name}: rank {p} sent {self.heads[i][INLINE_AT]} "
                                 f"bytes in its envelope, this rank expected {nb}")
        got = envelopes(self.comm).views(nb, t.dtype)[1][i]
        t.copy_(got if t.dim() == 1 else got.view(t.shape))
        self.got[i] = nb

    def open(self, ops):
        comm, peers = self.comm, self.peers
        self.opened = True
        env = envelopes(comm)
        row = {p: i for i, p in enumerate(peers)}
        head = [0] * len(peers)                 # bytes of each envelope: header + inline payload
        follow = {}                             # peer -> the first message, sent behind its envelope
        reqs, text = [], "; ".join(self.errors).encode()[:ENVELOPE_PAYLOAD]
        words = env.out_np[:, :NH * 8].view("int64")
        words[:, :9] = [MAGIC, *self.meta]
        words[:, ERR:] = 0
        if text:
            words[:, ERR] = len(text)
            payload = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            for i in range(len(peers)):
                env.out[i, HEADER_BYTES:HEADER_BYTES + len(text)].copy_(payload)
                head[i] = len(text)
            ops = []
        first = set()
        for kind, t, p in ops:
            if kind == "send" and p not in first:
                first.add(p)
                nb = t.numel() * t.element_size()
                i = row[p]
                if nb <= INLINE:                     # cached views: a torch view costs ~10 µs here
                    env.views(nb, t.dtype)[0][i].copy_(t if t.dim() == 1 else t.reshape(-1))
                    words[i, INLINE_AT], head[i] = nb, nb
                    self.sent_inline[i] = nb
                    reqs.append(DONE)
                else:
                    words[i, FOLLOW] = nb
                    follow[p] = t
                    reqs.append(None)            # filled below, once posted
            else:
                reqs.append(Work(comm, _Later(self, kind, t, p), p, kind))
        self.later = [r.handle for r in reqs if r is not None and isinstance(r.handle, _Later)]
        env_ops = ([("upto", r, p) for r, p in zip(env.rows(env.inc), peers)]
                   + [("send", r, p) for r, p in zip(env.rows(env.out, *head), peers)])
        with LEDGER.control_traffic():
            posted = comm._post_raw(env_ops)
        self.env_in, self.mine = posted[:len(peers)], posted[len(peers):]   # a Work reaches the transport once
        if follow:
            early = comm._post_raw([("send", t, p) for p, t in follow.items()])
            self.mine += early
            it = iter(early)
            reqs = [next(it) if r is None else r for r in reqs]
        return reqs

    # ---- the verdict: every rank, from the same N fingerprints
    def settle(self) -> None:
        if self.settled:
            if self.failed is not None:          # every later wait of the aborted call raises too
                raise CollectiveError(self.failed)
            return
        if not self.opened:
            self.open([])
        self.settled = True
        comm, peers = self.comm, self.peers
        for r in self.env_in:
            r.wait()
        env = envelopes(comm)
        heads = env.inc_np[:, :NH * 8].view("int64").tolist()
        problem = verdict(comm, self.name, [MAGIC, *self.meta, len(self.errors)], self.errors,
                          peers, heads, envelope_text(env.inc))
        if problem is not None:
            self.failed = problem
            self._drain(heads)
            raise CollectiveError(problem)
        self.heads = heads
        self.inline_left = {p: i for i, p in enumerate(peers) if heads[i][INLINE_AT]}
        posts = []
        for lt in self.later:
            if lt.kind == "recv" and lt.peer in self.inline_left:
                self._fill(lt.t, lt.peer)
            else:
                posts.append(lt)
        if posts:
            for lt, r in zip(posts, comm._post_raw([(lt.kind, lt.t, lt.peer) for lt in posts])):
                lt.req = r
        self.later = []      # each handle has its request now; kept, they would form a cycle (handle.ib ↔
                             # self.later) that holds the call's tensors until Python's cycle collector runs

    def _drain(self, heads) -> None:
        """Nothing of the aborted call stays in flight: receive what was announced to me, wait for mine."""
        try:
            drain(self.comm, self.peers, heads)
            for r in self.mine:
                r.wait()
        except Exception:        # a peer died while we cleaned up: the mismatch is the news
            pass

    def finish(self) -> None:
        """End of the call: the verdict reached (also by ranks whose algorithm posted nothing or
        only sent), and my envelopes delivered."""
        self.settle()
        for r in self.mine:
            r.wait()
        if any(self.got) or any(self.sent_inline):     # the inline messages are this call's data
            count_fused(self.comm, self.peers, self.sent_inline, self.got)
