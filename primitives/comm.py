"""Communicator: the one small interface every algorithm in ringzero talks through.

    rank, size, device        this process's place in the group, and where its buffers live
    isend(t, peer) / irecv(t, peer) -> Request      non-blocking point-to-point
    send(t, peer) / recv(t, peer)                   the blocking forms
    exchange(sends=[(t, peer)], recvs=[(t, peer)]) -> [Request]
                                                    several sends and receives posted as ONE
                                                    group (nccl: dist.batch_isend_irecv)
    builtin                                         the backend's own collectives (references only)

Two implementations share it:
  * TorchComm  — torch.distributed point-to-point, gloo (CPU tensors) or nccl (CUDA tensors);
  * MPIComm    — mpi4py on CPU tensors (torch wheels ship no MPI backend).

Peers are *group* ranks (0..size-1); TorchComm maps them to global ranks. Every message is
recorded in primitives.engine.ledger.LEDGER. Every wait has a deadline (`timeout`, default 60 s,
env RINGZERO_TIMEOUT): a peer that died or never arrives becomes a PeerError naming this
rank and the peer, never a silent hang. No torch.cuda.synchronize() here: nccl ordering is
stream-ordered, and wait() on a Work is enough.

Why groups: torch's nccl process group runs each ungrouped send/recv on a stream shared by the
pair of ranks, in posting order, and a send only completes once the peer's matching receive
runs. A rank that posts irecv(peer) then isend(peer) while the peer does the same waits forever:
each receive sits in front of the send the other side needs. A group (ncclGroupStart/End, i.e.
batch_isend_irecv) progresses all its operations together, so an exchange cannot deadlock.
Every step of every algorithm that both sends to and receives from a peer uses exchange().
Strict mode (primitives/engine/strict.py, env RINGZERO_STRICT_P2P=1 or set_strict(True)) replays
those nccl ordering rules over gloo so tests on CPU catch a pattern that would hang on GPUs.
"""
from __future__ import annotations

import abc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from primitives.engine.ledger import LEDGER

DEFAULT_TIMEOUT = float(os.environ.get("RINGZERO_TIMEOUT", "60"))


class PeerError(RuntimeError):
    """A point-to-point transfer failed or timed out; the message names both ranks.
    dead: the group rank a transport *knows* died (shm: its pid is gone), which may not be the
    peer this rank was waiting on; the root cause (faults.py) then names it, not the peer."""

    def __init__(self, *args, dead: int | None = None):
        super().__init__(*args)
        self.dead = dead


class NotInitializedError(RuntimeError):
    pass


NOT_INIT_MSG = (
    "no process group is initialised. Launch with one of:\n"
    "  torchrun --nproc_per_node 4 SCRIPT.py             (gloo, or nccl with one GPU per rank)\n"
    "  mpiexec -n 4 python SCRIPT.py --backend mpi       (needs `pip install mpi4py mpich`)\n"
    "or call primitives.engine.launch.init_from_env() / primitives.engine.launch.spawn(fn, world_size) first."
)


class Request:
    """A pending send or receive. wait() honours the communicator's deadline."""

    def __init__(self, comm: "Communicator", handle, peer: int, kind: str):
        self.comm, self.handle, self.peer, self.kind = comm, handle, peer, kind

    def wait(self) -> None:
        try:
            self.comm._wait(self.handle)
        except Exception as e:  # gloo raises RuntimeError with its own wording; add who, whom, and why
            raise self.comm._peer_error(self.peer, self.kind, e) from e


class _Done:
    def wait(self) -> None:
        pass


_DONE = _Done()


class Communicator(abc.ABC):
    rank: int
    size: int
    backend: str
    device: torch.device
    timeout: float = DEFAULT_TIMEOUT

    # Empty messages are skipped on both sides (both know the size), so they cost nothing
    # and never appear in the ledger.
    def isend(self, tensor: torch.Tensor, peer: int) -> Request:
        if tensor.numel() == 0:
            return _DONE
        if self.strict:
            return self._strict_post([("send", tensor, peer)], grouped=False)[0]
        LEDGER.sent(tensor.numel() * tensor.element_size(), self.link_to(peer))
        return Request(self, self._post(self._isend, tensor, peer, "sending to"), peer, "sending to")

    def irecv(self, tensor: torch.Tensor, peer: int) -> Request:
        if tensor.numel() == 0:
            return _DONE
        if self.strict:
            return self._strict_post([("recv", tensor, peer)], grouped=False)[0]
        LEDGER.received(tensor.numel() * tensor.element_size(), self.link_to(peer))
        return Request(self, self._post(self._irecv, tensor, peer, "receiving from"), peer, "receiving from")

    def exchange(self, sends=(), recvs=()) -> list:
        """Post every (tensor, peer) receive and send as one group; returns their requests,
        receives first (in the order given), then sends. Empty tensors are skipped, as above."""
        ops = [("recv", t, p) for t, p in recvs if t.numel()] + [("send", t, p) for t, p in sends if t.numel()]
        if not ops:
            return []
        if self.strict:
            return self._strict_post(ops, grouped=True)
        for kind, t, p in ops:
            (LEDGER.received if kind == "recv" else LEDGER.sent)(t.numel() * t.element_size(), self.link_to(p))
        try:
            handles = self._group(ops)
        except Exception as e:
            raise self._peer_error(ops[0][2], "exchanging with", e) from e
        return [Request(self, h, p, "receiving from" if k == "recv" else "sending to")
                for h, (k, _, p) in zip(handles, ops)]

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
        """Swap buffers with one peer (one group) and wait for both directions."""
        for r in self.exchange(sends=[(send, peer)], recvs=[(recv, peer)]):
            r.wait()

    def _group(self, ops) -> list:
        """Post a group of ("send"|"recv", tensor, peer). Default: one operation at a time, which
        is a group for any transport whose posted operations progress independently (gloo, MPI)."""
        return [self._irecv(t, p) if k == "recv" else self._isend(t, p) for k, t, p in ops]

    # ---- collectives as methods: what the textbook layers above (DDP, ZeRO, tensor parallel) call.
    # Ranks are this communicator's group ranks; op is "sum" | "avg" | "min" | "max" | "product".
    # Keywords (algorithm=, tag=, async_op=) pass through to the checked drop-in functions.
    def all_reduce(self, tensor, op="sum", **kw):
        from primitives.all_reduce import all_reduce   # the collectives import this module
        return all_reduce(tensor, op, group=self, **kw)

    def broadcast(self, tensor, src, **kw):
        from primitives.broadcast import broadcast
        return broadcast(tensor, self.global_rank(src), group=self, **kw)

    def all_gather(self, tensor_list, tensor, **kw):
        from primitives.all_gather import all_gather
        return all_gather(tensor_list, tensor, group=self, **kw)

    def all_gather_single(self, output, input, **kw):
        from primitives.all_gather import all_gather_single
        return all_gather_single(output, input, group=self, **kw)

    def reduce_scatter(self, output, input_list, op="sum", **kw):
        from primitives.reduce_scatter import reduce_scatter
        return reduce_scatter(output, input_list, op, group=self, **kw)

    def reduce_scatter_single(self, output, input, op="sum", **kw):
        from primitives.reduce_scatter import reduce_scatter_single
        return reduce_scatter_single(output, input, op, group=self, **kw)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        from primitives.all_to_all import all_to_all_single
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=self, **kw)

    # strict mode: nccl's ordering rules replayed on this transport (primitives/engine/strict.py)
    _strict_flag: bool | None = None
    _strict_sched = None

    @property
    def strict(self) -> bool:
        from primitives.engine import strict
        return strict.enabled() if self._strict_flag is None else self._strict_flag

    def set_strict(self, enabled: bool | None) -> None:
        """True/False for this communicator; None follows the process default (set_strict_p2p)."""
        self._strict_flag = enabled

    def _strict_post(self, ops, grouped):
        from primitives.engine import strict
        if self._strict_sched is None:
            self._strict_sched = strict.Scheduler(self)
        for kind, t, p in ops:
            (LEDGER.received if kind == "recv" else LEDGER.sent)(t.numel() * t.element_size(), self.link_to(p))
        return self._strict_sched.post(ops, grouped)

    # ---- multinode topology (primitives/engine/topology.py): which node each rank is on
    def node_of(self, rank: int) -> int:
        """The node (0..num_nodes-1) of group rank `rank`."""
        from primitives.engine.topology import topology
        return topology(self).node_of(self.global_rank(rank))

    def link_to(self, peer: int) -> str:
        """"intra" when `peer` shares this rank's node, else "inter" (for the ledger)."""
        from primitives.engine.topology import topology
        t = topology(self)
        return "intra" if t.node_of(self.global_rank(peer)) == t.node_of(self.global_rank(self.rank)) else "inter"

    def intra_node(self) -> "Communicator":
        """The ranks of this communicator on this rank's node (see primitives/engine/topology.py)."""
        from primitives.engine.topology import split
        return split(self)[0]

    def inter_node(self) -> "Communicator":
        """One rank per node: those with this rank's local index."""
        from primitives.engine.topology import split
        return split(self)[1]

    def _post(self, fn, tensor, peer, kind):
        # gloo can fail when the operation is posted (the peer has already gone), not only in wait()
        try:
            return fn(tensor, peer)
        except Exception as e:
            raise self._peer_error(peer, kind, e) from e

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.isend(tensor, peer).wait()

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self.irecv(tensor, peer).wait()

    def _peer_error(self, peer: int, kind: str, err: Exception | None = None) -> PeerError:
        """The PeerError for a failed transfer, naming the rank that really died (faults.py)."""
        from primitives.engine.faults import root_cause
        dead = getattr(err, "dead", None)     # the transport saw which rank died: suspect it, not `peer`
        suspect, certain = (peer, False) if dead is None else (dead, True)
        return PeerError(self._describe(peer, kind, err) + root_cause(self, suspect, kind, certain=certain),
                         dead=dead)

    def _describe(self, peer: int, kind: str, err: Exception | None = None) -> str:
        why = f": {err}" if err is not None else ""
        call = str(getattr(self, "current_call", "") or "")
        return (f"rank {self.rank}: failed {kind} rank {peer}{' in ' + call if call else ''} (backend {self.backend}, "
                f"timeout {self.timeout:.0f}s; did rank {peer} die or skip this call?){why}")

    # what a backend provides: post a send / a receive, and wait for one (honouring self.timeout)
    @abc.abstractmethod
    def _isend(self, tensor, peer): ...

    @abc.abstractmethod
    def _irecv(self, tensor, peer): ...

    @abc.abstractmethod
    def _wait(self, handle): ...

    @abc.abstractmethod
    def global_rank(self, group_rank: int) -> int: ...


class TorchComm(Communicator):
    """torch.distributed point-to-point over gloo or nccl, optionally inside a subgroup."""

    def __init__(self, group=None, timeout: float | None = None):
        if not dist.is_initialized():
            raise NotInitializedError(NOT_INIT_MSG)
        self.group = group
        _check_member(group)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]
        self.builtin = dist

    def global_rank(self, group_rank: int) -> int:
        return self._global[group_rank]

    def _isend(self, tensor, peer):
        return dist.isend(tensor, self._global[peer], group=self.group)

    def _irecv(self, tensor, peer):
        return dist.irecv(tensor, self._global[peer], group=self.group)

    def _group(self, ops):
        if self.backend != "nccl":
            return super()._group(ops)
        p2p = [dist.P2POp(dist.irecv if k == "recv" else dist.isend, t, self._global[p], group=self.group)
               for k, t, p in ops]
        works = dist.batch_isend_irecv(p2p)
        return works if len(works) == len(ops) else [works[-1]] * len(ops)  # coalesced into one Work

    def _wait(self, handle):
        if not handle.wait(timeout=timedelta(seconds=self.timeout)):
            raise PeerError(f"timed out after {self.timeout:.0f}s")


def _check_member(group) -> None:
    """A clear error for a rank outside `group`, before anything else touches the group
    (dist.get_backend and the shm rendezvous would fail with torch's "Invalid process group")."""
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()}: this process is not a member of the group it passed")


class MPIComm(Communicator):
    """mpi4py point-to-point on CPU tensors, sent as raw bytes (so bf16/fp16 travel too)."""

    def __init__(self, mpi_comm=None, timeout: float | None = None):
        from mpi4py import MPI
        self.MPI = MPI
        self.mpi = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        self.backend, self.device = "mpi", torch.device("cpu")
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.builtin = self.mpi

    def global_rank(self, group_rank: int) -> int:
        return group_rank

    @staticmethod
    def _bytes(tensor):
        if not tensor.is_contiguous():
            raise ValueError("internal: MPIComm needs contiguous buffers")
        return tensor.reshape(-1).view(torch.uint8).numpy()

    def _isend(self, tensor, peer):
        return self._track(self.mpi.Isend([self._bytes(tensor), self.MPI.BYTE], dest=peer, tag=7))

    def _irecv(self, tensor, peer):
        return self._track(self.mpi.Irecv([self._bytes(tensor), self.MPI.BYTE], source=peer, tag=7))

    def _track(self, req):
        self.__dict__.setdefault("_posted", []).append(req)
        return req

    def _wait(self, req):
        # MPI_Wait has no deadline, so poll. Yield the core between polls (sleep(0)) instead of
        # napping: with more ranks than cores the peer needs the CPU, and a nap of even 100 µs
        # per dependent step showed up as a 2x slower ring all-reduce at 4 ranks on 2 cores.
        if not req.Test():
            deadline, spins = time.monotonic() + self.timeout, 0
            while not req.Test():
                spins += 1
                time.sleep(0)
                if spins % 4096 == 0 and time.monotonic() > deadline:
                    left = self.cancel_posted()
                    raise PeerError(f"timed out after {self.timeout:.0f}s; cancelled this rank's posted "
                                    f"operations" + (f" ({left} could not be cancelled)" if left else ""))
        posted = self.__dict__.get("_posted", [])
        if len(posted) > 64:                  # forget finished requests now and then
            self._posted = [r for r in posted if r is not req and not r.Test()]

    def cancel_posted(self, grace: float = 1.0) -> int:
        """Cancel every operation this communicator posted that has not completed, so a late
        message can never land in a tensor the caller has since reused. Returns how many
        could not be cancelled within `grace` seconds (MPI may refuse to cancel a matched send)."""
        posted, self._posted = self.__dict__.get("_posted", []), []
        live = [r for r in posted if not r.Test()]
        for r in live:
            try:
                r.Cancel()
            except Exception:
                pass
        deadline = time.monotonic() + grace
        while live and time.monotonic() < deadline:
            live = [r for r in live if not r.Test()]
            time.sleep(0.001)
        return len(live)


_MPI_WORLD: MPIComm | None = None
_COMMS: dict = {}


def set_mpi_world(comm: MPIComm | None) -> None:
    global _MPI_WORLD
    _MPI_WORLD = comm
    _COMMS.clear()


def get_comm(group=None) -> Communicator:
    """The communicator for `group` (None = the default group, or MPI's COMM_WORLD)."""
    if _MPI_WORLD is not None:
        if group is None or group is _MPI_WORLD:
            return _MPI_WORLD
        if isinstance(group, Communicator):
            return group
        key = ("mpi", id(group))
        if key not in _COMMS:
            _COMMS[key] = MPIComm(group, _MPI_WORLD.timeout)
        return _COMMS[key]
    if isinstance(group, Communicator):
        return group
    if not dist.is_initialized():
        raise NotInitializedError(NOT_INIT_MSG)
    if group is dist.group.WORLD:            # the same group as None: one communicator for both
        group = None
    key = id(group) if group is not None else None
    c = _COMMS.get(key)
    if c is None or c.group is not group:
        _check_member(group)                 # first: build() asks the group for its backend
        from primitives.engine.shm import build   # transport hook (shm): RINGZERO_TRANSPORT=auto|shm|tcp
        c = _COMMS[key] = build(group)       # ShmComm on gloo (falls back to TCP), TorchComm otherwise
    return c
