"""ShmComm: point-to-point through shared memory between ranks on one host, the process
group's own transport (gloo over TCP) to ranks elsewhere. Every collective × algorithm runs
on it unchanged; shm_collectives.py adds the ones that read peers' buffers directly.

    RINGZERO_TRANSPORT=shm torchrun --nproc_per_node 4 primitives/all_reduce.py
    RINGZERO_TRANSPORT=tcp ...        (gloo for everything)   auto (default): shm where it can

Transport of a message of S bytes: per ordered pair (src, dst) a channel, a ring of K slots of
C bytes (RINGZERO_SHM_SLOTS, RINGZERO_SHM_SLOT_BYTES). The sender copies the message straight
from its tensor into free slots, C bytes at a time, and publishes each with a counter; the
receiver copies each slot straight into its tensor and hands the slot back. So a large
message is pipelined through K slots: 2 copies of S in all (gloo: 2 copies plus the kernel's
socket buffers), and no system call per message except a wake-up when the peer sleeps.
The counters rely on x86's store order (TSO): data is written before the counter publishing it.

Semantics are MPI's: messages between a pair arrive in posting order; isend completes once
its bytes are in the ring (buffered); nothing moves in the background, so every wait() also
advances every other pending transfer of this communicator (no deadlock when two ranks
send to each other before receiving). Waiting spins 32 polls, yields the core for
shm_segment.yield_s() (0.5 ms when ranks outnumber cores, else 0), then blocks on a futex "doorbell" in the segment that every
publisher rings (≤ 5 ms per block, so nothing waits on a lost wake-up for long); every 50 ms
it checks each local peer's pid (with its start time, so a reused pid does not count): a
dead peer is a PeerError naming it, the deadline (`timeout`) one naming the peer waited for.
A receive whose sender posted a different size is a PeerError too, never a silent truncation.
"""
from __future__ import annotations

import collections
import os
import platform
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from primitives.engine import faults, shm_segment as seg
from primitives.engine.faults import Rounds, arrive
from primitives.engine.checked import DEFAULT_TIMEOUT
from primitives.engine.comms import CheckedTorchComm
from primitives.engine.errors import PeerError
from primitives.engine.shm_segment import (LINE, SLEEP_OFF, SLOT_BYTES, SLOTS, SPIN, TRANSPORTS, WS_BYTES,  # noqa: F401
                                          layout, transport_from_env)

class _Op:
    __slots__ = ("peer", "kind", "buf", "total", "off", "done", "out", "upto")

    def __init__(self, peer, kind, buf, out=None, upto=False):
        self.peer, self.kind, self.buf, self.out, self.upto = peer, kind, buf, out, upto
        self.total, self.off, self.done = buf.numel(), 0, False


def _advance(queue, op: _Op, k: int) -> None:
    """k more bytes of the op at the head of queue moved; pop it when complete."""
    op.off += k
    if op.off == op.total:
        op.done = True
        queue.popleft()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class ShmComm(CheckedTorchComm):
    """A CheckedTorchComm whose messages to ranks on this host go through shared memory."""

    def __init__(self, group=None, timeout: float | None = None, transport: str | None = None):
        super().__init__(group, timeout)
        want = transport_from_env(transport)
        self.transport, self.local, self.mm, self.token = "tcp", {}, None, None
        self.why_not = ("a world of one" if self.size == 1 else f"backend {self.backend}" if self.backend != "gloo"
                        else f"RINGZERO_TRANSPORT={want}")
        self._lock = threading.RLock()
        if platform.machine() not in ("x86_64", "AMD64"):     # the slot counters rely on x86's store order
            self.why_not = f"{platform.machine()} is not x86-64 (no total store order)"
            if want == "shm":
                raise ValueError(f"rank {self.rank}: transport 'shm' asked for, but {self.why_not}")
            return
        if want == "tcp" or self.size == 1 or self.backend != "gloo":
            if want == "shm" and self.backend != "gloo":
                raise ValueError(f"rank {self.rank}: transport 'shm' needs CPU tensors (backend gloo), "
                                 f"this group uses {self.backend}")
            arrive(self)                  # set-up through the store: a rank that never arrives is named
            return
        faults.hello()                    # set-up through the store (faults.py), round 1 = arrival
        mm, local, procs, self.token, why = seg.rendezvous(
            group, self.rank, self.size, lambda n: layout(n)["total"], Rounds(self, "shared-memory rendezvous").gather)
        self.why_not = why
        if mm is None:
            if want == "shm":
                raise ValueError(f"rank {self.rank}: transport 'shm' asked for, but {why}; "
                                 "use RINGZERO_TRANSPORT=auto or tcp")
            return
        self._setup(mm, local, procs)
        if want == "shm" and len(local) != self.size:
            far = [r for r in range(self.size) if r not in self.local]
            raise ValueError(f"rank {self.rank}: transport 'shm' asked for, but ranks {far} are on "
                             "other hosts; use RINGZERO_TRANSPORT=auto (shm here, tcp to them)")

    def _setup(self, mm, local, procs):
        self.mm, n = mm, len(local)
        self.L = L = layout(n)
        self.local = {r: i for i, r in enumerate(local)}           # group rank -> index on this host
        self.me = self.local[self.rank]
        self.procs = dict(zip(local, procs))
        self.transport = "shm" if n == self.size else "shm+tcp"
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8)
        self.i64 = np.frombuffer(mm, dtype=np.int64)
        self.i32 = np.frombuffer(mm, dtype=np.int32)
        self._base = seg.base_address(mm)
        self.n_local = n
        self._sendq = {r: collections.deque() for r in local if r != self.rank}
        self._recvq = {r: collections.deque() for r in local if r != self.rank}
        self._head = {r: 0 for r in local}                         # chunks I published to r
        self._tail = {r: 0 for r in local}                         # chunks I consumed from r
        self._busy: set[int] = set()
        self.yield_s, self.calm = seg.yield_s(n), 0.0               # spin_until's yield phase; no yield before calm
        self.spin = SPIN if self.yield_s == 0 else 2                # oversubscribed: yield almost at once

    # ------------------------------------------------------------------ channel geometry
    def _chan(self, src_rank: int, dst_rank: int) -> int:
        return self.L["chan0"] + (self.local[src_rank] * self.n_local + self.local[dst_rank]) * self.L["chan"]

    def _door(self, rank: int) -> int:
        """Byte offset of rank's doorbell: an int32 in its control line."""
        return self.L["ctl"] + self.local[rank] * LINE + 32

    def ring(self, rank: int) -> None:
        """Tell rank something it may be waiting for changed: bump its doorbell, wake it."""
        d = self._door(rank)
        self.i32[d // 4] += 1
        seg.futex_wake(self._base + d)

    def _slot(self, chan: int, seq: int) -> int:
        return chan + 2 * LINE + (seq % SLOTS) * self.L["slot"]

    # ------------------------------------------------------------------ post
    def _isend(self, tensor, peer):
        if peer not in self.local:
            return super()._isend(tensor, peer)
        src = tensor if tensor.is_contiguous() else tensor.contiguous()   # snapshot now: buffered send
        return self._post_op(_Op(peer, "sending to", _bytes(src)), self._sendq)

    def _irecv(self, tensor, peer):
        if peer not in self.local:
            return super()._irecv(tensor, peer)
        if tensor.is_contiguous():
            return self._post_op(_Op(peer, "receiving from", _bytes(tensor)), self._recvq)
        tmp = torch.empty(tensor.shape, dtype=tensor.dtype)
        return self._post_op(_Op(peer, "receiving from", _bytes(tmp), out=(tensor, tmp)), self._recvq)

    def _irecv_upto(self, tensor, peer):   # a message of at most tensor's bytes (inband.py's envelopes)
        if peer not in self.local:
            return super()._irecv(tensor, peer)              # gloo takes a shorter message as it is
        return self._post_op(_Op(peer, "receiving from", _bytes(tensor), upto=True), self._recvq)

    def _post_op(self, op, queues):
        with self._lock:
            queues[op.peer].append(op)
            self._busy.add(op.peer)
            self._progress()                                   # eager: small messages leave at once
        return op

    # ------------------------------------------------------------------ progress
    def _progress(self) -> None:
        i64, u8, C = self.i64, self.u8, SLOT_BYTES
        for peer in list(self._busy):
            sq, rq = self._sendq[peer], self._recvq[peer]
            if sq:
                ch = self._chan(self.rank, peer)
                head, tail = self._head[peer], int(i64[(ch + LINE) // 8])
                while sq and head - tail < SLOTS:
                    op = sq[0]
                    k = min(C, op.total - op.off)
                    s = self._slot(ch, head)
                    i64[s // 8], i64[s // 8 + 1] = op.total, k
                    u8[s + LINE:s + LINE + k].copy_(op.buf[op.off:op.off + k])
                    head += 1
                    i64[ch // 8] = head                          # publish after the data (TSO)
                    _advance(sq, op, k)
                if head != self._head[peer]:
                    self._head[peer] = head
                    self.ring(peer)
            if rq:
                ch = self._chan(peer, self.rank)
                tail, head = self._tail[peer], int(i64[ch // 8])
                while rq and tail < head:
                    op = rq[0]
                    s = self._slot(ch, tail)
                    total, k = int(i64[s // 8]), int(i64[s // 8 + 1])
                    if total != op.total and op.upto and op.off == 0 and total < op.total:
                        op.total = total                          # "up to": take the shorter message
                    if total != op.total:
                        raise PeerError(self._describe(peer, op.kind, RuntimeError(
                            f"rank {peer} sent a message of {total} bytes, this rank posted a receive "
                            f"of {op.total} bytes (mismatched calls)")), attributed=True)
                    op.buf[op.off:op.off + k].copy_(u8[s + LINE:s + LINE + k])
                    tail += 1
                    i64[(ch + LINE) // 8] = tail                  # hand the slot back
                    _advance(rq, op, k)
                if tail != self._tail[peer]:
                    self._tail[peer] = tail
                    self.ring(peer)                                 # its sender may wait for a slot
            if not sq and not rq:
                self._busy.discard(peer)

    # ------------------------------------------------------------------ wait
    def _wait(self, handle):
        if not isinstance(handle, _Op):
            return super()._wait(handle)
        if not handle.done:
            self.spin_until(lambda: handle.done, handle.peer, handle.kind, progress=True)
        if handle.out is not None:
            tensor, tmp = handle.out
            tensor.copy_(tmp)
            handle.out = None

    def _completed(self, handle) -> bool:
        if not isinstance(handle, _Op):
            return super()._completed(handle)
        with self._lock:
            self._progress()                     # nothing moves in the background: advance it here
        return handle.done

    def spin_until(self, ready, peer, kind: str, progress: bool = False) -> bool:
        """Poll ready() (advancing transfers when progress): spin self.spin polls (SPIN, or 2 when
        ranks outnumber cores: my polling delays the peer that shares my core), yield the core for
        self.yield_s (shm_segment.yield_s; none for a second after a yield that came back only after
        another process's time slice), then raise my "asleep" flag (the shm collectives'
        publishers ring only then), poll once more and block on my doorbell (futex, ≤ 5 ms a
        time) until a peer rings it.
        Every 50 ms a dead local peer, and the deadline, become a PeerError naming `peer` (the
        rank waited for, or a function giving it). The one wait loop of both transports' waits.
        Returns whether ready() came true within the spin polls (no yield, no sleep)."""
        spins, start, check = 0, None, 0.0
        door = self._door(self.rank)
        sleep = (door - 32 + SLEEP_OFF) // 4             # my int32 "asleep" flag, in the same control line
        try:
            while True:
                bell = int(self.i32[door // 4])          # read before checking: no lost wake-up
                if progress:
                    with self._lock:
                        self._progress()
                if ready():
                    return spins < self.spin
                spins += 1
                if spins < self.spin:
                    continue
                now = time.monotonic()
                if start is None:
                    start, check = now, now + 0.05      # liveness: /proc reads cost ~1 ms under load
                if now - start < self.yield_s and now >= self.calm:
                    os.sched_yield()
                    if time.monotonic() - now > seg.YIELD_SLOW:   # another job's slice ran, not my peer:
                        self.calm = now + 1.0                    # sleep at once for a second
                    continue
                if not self.i32[sleep]:
                    self.i32[sleep] = 1
                    continue                             # poll once more after saying I sleep
                who = peer() if callable(peer) else peer
                if now >= check:
                    self._check_peers(who, kind)
                    check = now + 0.05
                if now - start > self.timeout:
                    raise self._peer_error(who, kind, RuntimeError(
                        f"timed out after {self.timeout:.0f}s on the shared-memory transport"))
                seg.futex_wait(self._base + door, bell, 5e-3)
        finally:
            self.i32[sleep] = 0

    def _check_peers(self, peer: int, kind: str) -> None:
        """A local peer whose process is gone ends the wait, even if it is not `peer`; the
        PeerError names the root cause (faults.py): r itself, or, if r reported a failure before
        it exited, the rank r saw die."""
        for r in [peer] + [r for r in self.procs if r not in (peer, self.rank)]:
            if r in self.procs and not seg.alive(*self.procs[r]):
                why = faults.PID_GONE.format(pid=self.procs[r][0])
                raise self._peer_error(peer, kind, PeerError(f"rank {r} {why}", dead=r, evidence=why))


def build(group=None, timeout: float | None = None, transport: str | None = None) -> CheckedTorchComm:
    """The communicator get_comm() builds: ShmComm on gloo (it falls back to plain TCP by itself),
    CheckedTorchComm otherwise (nccl tensors live on the GPU). timeout: default $RINGZERO_TIMEOUT as it is now."""
    timeout = float(os.environ.get("RINGZERO_TIMEOUT", DEFAULT_TIMEOUT)) if timeout is None else timeout
    if dist.get_backend(group) != "gloo":
        if transport_from_env(transport) == "shm":
            raise ValueError(f"transport 'shm' needs backend gloo, not {dist.get_backend(group)}")
        return arrive(CheckedTorchComm(group, timeout)).comm    # set-up through the store (faults.py)
    return ShmComm(group, timeout, transport)


def describe(comm) -> str:
    """One line for a script's start-up output: which transport its bytes travel on."""
    t = getattr(comm, "transport", comm.backend)
    where = {"shm": "shared memory, every rank on this host", "tcp": f"{comm.backend} over TCP",
             "shm+tcp": "shared memory within a host, TCP between hosts"}.get(t, f"{comm.backend}'s own")
    why = f"; shared memory not used: {comm.why_not}" if t == "tcp" and getattr(comm, "why_not", "") else ""
    return f"transport: {t} ({where}{why}; RINGZERO_TRANSPORT=auto|shm|tcp)"
