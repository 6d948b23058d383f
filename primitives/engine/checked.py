"""The checked Communicator: the textbook's (primitives/comm.py) with every message counted,
every wait under a deadline and nccl's ordering rules checked.

    python -m pytest -q -x tests/test_primitives_errors.py tests/test_strict_p2p.py

What it adds around the textbook's isend / irecv / exchange, which still post every message
(the algorithms are unchanged):
  * the ledger (ledger.py): bytes and messages sent and received, per link (intra/inter node);
  * deadlines: a wait longer than `timeout` (default 60 s, env RINGZERO_TIMEOUT) becomes a
    PeerError naming this rank, the peer and the call, and the rank that really died (faults.py);
  * strict mode (strict.py, env RINGZERO_STRICT_P2P=1 or set_strict(True)): nccl's ordering rules
    replayed over gloo, so tests on CPU catch a pattern that would hang on GPUs;
  * topology (topology.py): node_of / link_to, which node a peer is on.
The collective methods that run the checked call are added by comms.py (Collectives).
No torch.cuda.synchronize() here: nccl ordering is stream-ordered, and wait() on a Work is enough.
"""
from __future__ import annotations

import os
from concurrent.futures import Future

import torch.distributed as dist

from primitives import comm as textbook
from primitives.comm import Work
from primitives.engine import strict
from primitives.engine.errors import PeerError
from primitives.engine.faults import CLOSED, attribute, closed
from primitives.engine.ledger import LEDGER
from primitives.engine.topology import topology

DEFAULT_TIMEOUT = float(os.environ.get("RINGZERO_TIMEOUT", "60"))

NOT_INIT_MSG = (
    "no process group is initialised. Launch with one of:\n"
    "  torchrun --nproc_per_node 4 SCRIPT.py             (gloo, or nccl with one GPU per rank)\n"
    "  mpiexec -n 4 python SCRIPT.py --backend mpi       (needs `pip install mpi4py mpich`)\n"
    "or call primitives.launch.init_from_env() / primitives.launch.spawn(fn, world_size) first."
)


def _count(kind: str, t, link: str) -> None:
    (LEDGER.sent if kind == "send" else LEDGER.received)(t.numel() * t.element_size(), link)


class CheckedComm(textbook.Communicator):
    timeout: float = DEFAULT_TIMEOUT

    def isend(self, tensor, peer: int):
        return self._post_one("send", tensor, peer)

    def irecv(self, tensor, peer: int):
        return self._post_one("recv", tensor, peer)

    def _post_one(self, kind, tensor, peer):
        if tensor.numel() == 0:
            return textbook.DONE
        ib = self.__dict__.get("_inband")          # a checked call's first posting (inband.py)
        if ib is not None and (r := ib.post([(kind, tensor, peer)])) is not None:
            return r[0]
        if self.strict:
            return self._strict_post([(kind, tensor, peer)], grouped=False)[0]
        _count(kind, tensor, self.link_to(peer))
        what = "sending to" if kind == "send" else "receiving from"
        post = super().isend if kind == "send" else super().irecv      # the textbook's post
        try:             # gloo can fail when the operation is posted (the peer has already gone)
            return post(tensor, peer)
        except Exception as e:
            raise self._peer_error(peer, what, e) from e

    def exchange(self, sends=(), recvs=()) -> list:
        ops = [("recv", t, p) for t, p in recvs if t.numel()] + [("send", t, p) for t, p in sends if t.numel()]
        if not ops:
            return []
        ib = self.__dict__.get("_inband")          # a checked call's first posting (inband.py)
        if ib is not None and (r := ib.post(ops)) is not None:
            return r
        if self.strict:
            return self._strict_post(ops, grouped=True)
        for kind, t, p in ops:
            _count(kind, t, self.link_to(p))
        try:
            return super().exchange(sends, recvs)      # the textbook's one group, same order as ops
        except Exception as e:
            raise self._peer_error(None, f"exchanging with ranks {sorted({p for _, _, p in ops})}", e) from e

    def _post_raw(self, ops) -> list:
        """Post ("send" | "recv" | "upto", tensor, peer) operations as a group, counted, past the
        in-band check (the check's own messages). "upto": a receive that accepts a shorter message."""
        post = {"send": self._isend, "recv": self._irecv, "upto": self._irecv_upto}
        out = []
        for kind, t, p in ops:
            _count(kind, t, self.link_to(p))
            what = "sending to" if kind == "send" else "receiving from"
            try:
                out.append(Work(self, post[kind](t, p), p, what))
            except Exception as e:
                raise self._peer_error(p, what, e) from e
        return out

    def _finish(self, work) -> None:
        """The textbook's wait, with a failure turned into a PeerError naming both ranks. An async
        collective (a Future of core.run) and strict or in-band handles raise their own, already named."""
        h = work.handle
        if isinstance(h, Future):
            return h.result()
        if getattr(h, "waits_itself", False):      # strict mode's and the in-band check's: errors named
            return h.wait()
        try:
            self._wait(h)
        except Exception as e:  # gloo raises RuntimeError with its own wording; add who, whom, and why
            raise self._peer_error(work.peer, work.kind, e) from e

    def _completed(self, handle) -> bool:
        if isinstance(handle, Future):
            return handle.done()
        return handle.is_completed()

    def _irecv_upto(self, tensor, peer):
        """A receive of at most tensor's bytes: gloo and MPI take a shorter message as it is."""
        return self._irecv(tensor, peer)

    # ---- strict mode: nccl's ordering rules replayed on this transport (strict.py)
    _strict_flag: bool | None = None
    _strict_sched = None

    @property
    def strict(self) -> bool:
        return strict.enabled() if self._strict_flag is None else self._strict_flag

    def set_strict(self, enabled: bool | None) -> None:
        """True/False for this communicator; None follows the process default (set_strict_p2p)."""
        self._strict_flag = enabled
        for t in self.__dict__.get("_planned_by", {}).values():   # planned.py: Planned calls skip strict mode
            t.clear()

    def _strict_post(self, ops, grouped):
        if self._strict_sched is None:
            self._strict_sched = strict.Scheduler(self)
        for kind, t, p in ops:
            _count(kind, t, self.link_to(p))
        return self._strict_sched.post(ops, grouped)

    # ---- multinode topology (topology.py): which node each rank is on
    def node_of(self, rank: int) -> int:
        """The node (0..num_nodes-1) of group rank `rank`."""
        return topology(self).node_of(self.global_rank(rank))

    def link_to(self, peer: int) -> str:
        """"intra" when `peer` shares this rank's node, else "inter" (for the ledger)."""
        t = topology(self)
        return "intra" if t.node_of(self.global_rank(peer)) == t.node_of(self.global_rank(self.rank)) else "inter"

    # ---- errors that name both ranks
    def _peer_error(self, peer: int | None, kind: str, err: Exception | None = None) -> PeerError:
        """The PeerError for a failed transfer (peer None: posting a group failed, peer unknown),
        naming the rank that really died, once (faults.py). An error that already names it
        (raised inside a wait this one wraps) passes through unchanged."""
        if isinstance(err, PeerError) and err.attributed:
            return err
        dead, evidence = getattr(err, "dead", None), getattr(err, "evidence", None)
        if dead is None and peer is not None and closed(err):     # gloo: the peer's socket closed
            dead, evidence = peer, CLOSED
        suspect = peer if dead is None else dead     # the transport saw which rank died: suspect it
        named, cause = attribute(self, suspect, kind, evidence)
        return PeerError(self._describe(peer, kind, err, hint=not cause) + cause, dead=named, attributed=True)

    def _describe(self, peer: int | None, kind: str, err: Exception | None = None, hint: bool = True) -> str:
        why = f": {err}" if err is not None else ""
        call = str(getattr(self, "current_call", "") or "")
        whom = kind if peer is None else f"{kind} rank {peer}"
        ask = f"; did rank {peer} die or skip this call?" if hint and peer is not None else ""
        return (f"rank {self.rank}: failed {whom}{' in ' + call if call else ''} (backend {self.backend}, "
                f"timeout {self.timeout:.0f}s{ask}){why}")


def check_member(group) -> None:
    """A clear error for a rank outside `group`, before anything else touches the group
    (dist.get_backend and the shm rendezvous would fail with torch's "Invalid process group")."""
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()}: this process is not a member of the group it passed")
