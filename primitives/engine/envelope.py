"""The check as a round of its own: fixed-size envelopes, with small calls' data inside.

On CPU the check rides in the algorithm's first messages instead (inband.py, which shares this
module's header layout, buffers and verdict). This round is what runs on CUDA, in strict nccl
ordering, and for algorithm="shm" / "hierarchical". Each rank sends every other rank one
envelope of ENVELOPE_BYTES (primitives/engine/algos.py): a HEADER_BYTES fingerprint (the HEAD
words below) followed by a payload region. Because the size never depends on the arguments, a
mismatched call can never post a message of the wrong size (gloo aborts the process on that)
or wait for a message that never comes: after the round every rank holds every fingerprint,
and if any differ, or any rank flagged bad arguments (its error text rides in its payload
region), EVERY rank raises CollectiveError. On CPU its receives take shorter envelopes ("up
to"), and on a mismatch it receives what an in-band peer announced behind its envelope, so
the two kinds of check meet safely when ranks disagree about which one runs.

When the call's data fits in the payload region (≤ 64 KiB per message), the data travels in
the same envelopes: a small all-reduce (one_shot), all-gather (direct), broadcast (linear) or
reduce-scatter (direct) costs one round, check included.

    cost per rank: N-1 messages of ENVELOPE_BYTES, one round (α + (N-2)·o + (N-1)·E·β)

On CUDA the host never waits for the round (no synchronisation per call): the fingerprints are
compared on the device, the verdict is copied to pinned memory behind an event, and a
disagreement raises CollectiveError at this communicator's next call whose event has completed,
or at check_pending(comm) (which does wait). The data path then runs as if the check passed, so
a mismatch on CUDA is reported one call late (and NCCL may report a size mismatch first).
"""
from __future__ import annotations

import numpy as np
import torch

from primitives.engine.algos import ENVELOPE_BYTES, ENVELOPE_PAYLOAD, HEADER_BYTES
from primitives.engine.check import meta_desc
from primitives.engine.errors import CollectiveError
from primitives.engine.ledger import LEDGER
from primitives.engine.topology import topology
from primitives.ops import wait_all

MAGIC = 0x52494E47   # "RING": a stray message from another protocol is caught, not decoded
# the header's int64 words: MAGIC, the 8 fingerprint words (check.meta_desc's order), my error
# text's length, then inband.py's `inline` (bytes of my first message inside this envelope)
# and `follow` (bytes of my first message sent right behind it)
ERR, INLINE_AT, FOLLOW, NH = 9, 10, 11, 12


class Fused:
    """The data a fused call carries. send(peer) -> the 1-D contiguous tensor for `peer`'s
    envelope (or None); finish(got) completes the call locally, where got(nbytes, dtype) gives
    {peer: that peer's payload as a dtype tensor}, and returns the payload bytes it used from
    each peer (for the ledger): a list in check_round's peer order (me+1, me+2, ...) or {peer: bytes}.
    same_for_all: every peer gets the same payload, so one envelope is packed."""

    def __init__(self, send, finish, same_for_all: bool):
        self.send, self.finish, self.same_for_all = send, finish, same_for_all


def fits(payload_bytes: int) -> bool:
    return payload_bytes <= ENVELOPE_PAYLOAD


class _Envelopes:
    """One communicator's envelope buffers (fixed size: allocated once) and cached payload views:
    a slice or dtype view costs ~10 µs of host time per call on this machine, so the views a
    call needs are built once per (payload size, dtype) and reused."""

    def __init__(self, comm):
        n, dev = comm.size, comm.device
        self.out = torch.zeros(n - 1, ENVELOPE_BYTES, dtype=torch.uint8, device=dev)
        self.inc = torch.zeros(n - 1, ENVELOPE_BYTES, dtype=torch.uint8, device=dev)
        self.out_np = self.out.numpy() if dev.type == "cpu" else None
        self.inc_np = self.inc.numpy() if dev.type == "cpu" else None
        self.payload = {}

    def rows(self, buf, *used):
        """Row i of buf (out or inc) cut to HEADER_BYTES + used[i] bytes (no `used`: whole rows)."""
        key = (buf is self.out, used)
        r = self.payload.get(key)
        if r is None:
            r = self.payload[key] = [buf[i, :HEADER_BYTES + used[i]] if used else buf[i] for i in range(buf.shape[0])]
        return r

    def views(self, nbytes: int, dtype):
        """([out payload row i as dtype], [inc payload row i as dtype]) for nbytes of payload."""
        key = (nbytes, dtype)
        v = self.payload.get(key)
        if v is None:
            pick = lambda buf: [buf[i, HEADER_BYTES:HEADER_BYTES + nbytes].view(dtype)  # noqa: E731
                                for i in range(buf.shape[0])]
            v = self.payload[key] = (pick(self.out), pick(self.inc))
            if len(self.payload) > 256:
                self.payload.clear()
        return v


def envelopes(comm) -> _Envelopes:
    env = comm.__dict__.get("_envelopes")
    if env is None or env.out.device != comm.device:
        env = comm._envelopes = _Envelopes(comm)
    return env


def check_round(comm, name: str, meta: list[int], errors: list[str], fused: Fused | None) -> bool:
    """Run the round; raise CollectiveError on every rank on a mismatch. True when `fused` carried the data."""
    raise_deferred(comm)
    n, me = comm.size, comm.rank
    text = "; ".join(errors).encode()[:ENVELOPE_PAYLOAD]
    fused = None if errors else fused
    header = [MAGIC, *meta, len(text), 0, 0]
    peers = [(me + i) % n for i in range(1, n)]
    rows = 1 if fused is None or fused.same_for_all else n - 1
    env = envelopes(comm)
    out, inc = env.out, env.inc
    cpu = env.out_np is not None                # numpy views: ~1 µs where a torch op costs ~10
    if cpu:
        env.out_np[:rows, :NH * 8].view(np.int64)[:] = header
    else:
        out[:rows, :NH * 8].copy_(torch.tensor(header, dtype=torch.int64).view(torch.uint8).expand(rows, -1))
    sent = []
    if text:
        out[0, HEADER_BYTES:HEADER_BYTES + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    elif fused is not None:
        for i in range(rows):
            t = fused.send(peers[i])
            nb = 0 if t is None else t.numel() * t.element_size()
            if nb:
                env.views(nb, t.dtype)[0][i].copy_(t.view(-1))
            sent.append(nb)
    sends = [(out[0 if rows == 1 else i], p) for i, p in enumerate(peers)]
    # receives take shorter envelopes, so send only the bytes used (and meet inband.py's); views
    # (subcomm.py) keep whole envelopes through their own exchange, which recording.py logs
    upto = cpu and not getattr(comm, "strict", False) and not hasattr(comm, "parent")
    if upto:
        used = [len(text) if text else (sent[0 if rows == 1 else i] if sent else 0) for i in range(n - 1)]
        sends = [(t[:HEADER_BYTES + u], p) for (t, p), u in zip(sends, used)]
    with LEDGER.control_traffic():
        if upto:
            reqs = comm._post_raw([("upto", inc[i], p) for i, p in enumerate(peers)]
                                  + [("send", t, p) for t, p in sends])
        else:
            reqs = comm.exchange(sends=sends, recvs=[(inc[i], p) for i, p in enumerate(peers)])
        wait_all(reqs)
    if defer(comm):
        if errors:
            raise CollectiveError(f"rank {me}: {name}: " + "; ".join(errors))
        _defer_verdict(comm, name, torch.tensor(header).to(inc.device, non_blocking=True),
                       inc[:, :NH * 8].view(torch.int64))
        if fused is not None:
            received = fused.finish(lambda nb, dtype: dict(zip(peers, env.views(nb, dtype)[1])))
            count_fused(comm, peers, sent * (n - 1) if rows == 1 else sent, received)
        return fused is not None
    heads = (env.inc_np[:, :NH * 8].view(np.int64) if cpu else inc[:, :NH * 8].view(torch.int64)).tolist()
    problem = verdict(comm, name, header, errors, peers, heads, envelope_text(inc))
    if problem is not None:
        drain(comm, peers, heads)
        raise CollectiveError(problem)
    if fused is None:
        return False
    received = fused.finish(lambda nb, dtype: dict(zip(peers, env.views(nb, dtype)[1])))
    # the payload bytes are this call's data traffic; the envelopes stay counted as control
    count_fused(comm, peers, sent * (n - 1) if rows == 1 else sent, received)
    return True


def verdict(comm, name, mine, errors, peers, heads, text) -> str | None:
    """The error every rank raises, from my header `mine` and the peers' `heads` (rows of int64
    words, this module's layout, from envelopes or shm workspace headers; text(i, k): the k bytes
    of error text behind row i), or None if all agree."""
    me, n = comm.rank, comm.size
    if errors:
        return f"rank {me}: {name}: " + "; ".join(errors)
    table = {me: list(mine[:ERR + 1])}
    for i, p in enumerate(peers):
        table[p] = list(heads[i][:ERR + 1])
    for p in peers:
        if table[p][0] != MAGIC:
            return (f"rank {me}: {name}: rank {p} sent a message that is not a ringzero call "
                    f"header: its ranks are running different code or mixing protocols")
    bad = [p for p in range(n) if table[p][ERR]]
    if bad:
        row = {p: i for i, p in enumerate(peers)}
        why = "; ".join(f"rank {p}: " + text(row[p], table[p][ERR]).decode(errors="replace") for p in bad)
        return f"rank {me}: {name} aborted because rank(s) {bad} passed invalid arguments: {why}"
    for p in range(n):
        if table[p][1:ERR] != table[me][1:ERR]:
            return (f"rank {me}: {name}: ranks disagree on the call: rank {me} passed "
                    f"{meta_desc(table[me][1:])} but rank {p} passed {meta_desc(table[p][1:])}")
    return None


def envelope_text(inc):
    """verdict's text(i, k): the error text in received envelope i."""
    return lambda i, k: bytes(inc[i, HEADER_BYTES:HEADER_BYTES + k].cpu().tolist())


def drain(comm, peers, heads) -> None:
    """After a mismatch: receive every message a peer announced behind its envelope (`follow`
    bytes, inband.py), so nothing of the aborted call stays in flight."""
    with LEDGER.control_traffic():
        for i, p in enumerate(peers):
            nb = int(heads[i][FOLLOW]) if heads[i][0] == MAGIC else 0
            if nb > 0:                      # one at a time: they share the scratch buffer
                wait_all(comm._post_raw([("recv", comm.scratch(nb, torch.uint8, slot=7), p)]))


def count_fused(comm, peers, sent, received) -> None:
    """The fused payloads in the ledger as data, per peer's link (intra/inter node), like
    Communicator.exchange counts the unfused algorithm's messages. received: a list aligned
    with peers, or {peer: bytes} (broadcast: only from the root)."""
    if isinstance(received, dict):
        received = [received.get(p, 0) for p in peers]
    topo, links = comm.__dict__.get("_fused_links", (None, None))   # one lookup per call, not per peer
    if topo is not topology(comm):                                  # (set_topology may replace it)
        topo = topology(comm)
        links = [comm.link_to(p) for p in peers]
        comm._fused_links = (topo, links)
    LEDGER.data_moved(sent=sent, received=received, links=links)


# ----------------------------------------------------------------------------- CUDA: no host sync

def defer(comm) -> bool:
    """Compare fingerprints on the device instead of the host (CUDA: no synchronisation per call)."""
    return comm.device.type == "cuda"


def _defer_verdict(comm, name, mine, heads) -> None:
    bad = (heads[:, 1:] != mine[1:]).any(dim=1) | (heads[:, 0] != MAGIC)
    flag = torch.empty(bad.numel(), dtype=torch.bool, pin_memory=torch.cuda.is_available())
    flag.copy_(bad, non_blocking=True)
    event = None
    if torch.cuda.is_available() and bad.is_cuda:
        event = torch.cuda.Event()
        event.record()
    comm.__dict__.setdefault("_deferred", []).append((flag, event, getattr(comm, "current_call", name)))


def raise_deferred(comm, wait: bool = False) -> None:
    """Raise for the oldest finished device-side verdict that found a disagreement."""
    pending = comm.__dict__.get("_deferred")
    while pending:
        flag, event, call = pending[0]
        if event is not None and not wait and not event.query():
            return                                   # not finished yet: never block the host
        if event is not None:
            event.synchronize()
        pending.pop(0)
        if flag.any():
            pending.clear()
            raise CollectiveError(f"rank {comm.rank}: {call}: ranks disagreed on the call or passed invalid "
                            f"arguments (found on the device, reported at the next call; the other "
                            f"ranks' own errors say what they passed)")


def check_pending(comm) -> None:
    """Wait for every deferred (CUDA) verdict of `comm` and raise if any found a disagreement."""
    raise_deferred(comm, wait=True)
