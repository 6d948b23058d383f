"""The engine's only door to communication: primitives (default) or torch.distributed.

    engine, *_ = zero_from_scratch.initialize(..., comm_impl="primitives" | "torch")

Both libraries share torch's signatures, so the switch is `B = primitives` vs
`B = torch.distributed`. With primitives the ring algorithm is forced so the bytes match the
textbook formulas (reduce-scatter and all-gather send (N-1)/N·S, all-reduce 2(N-1)/N·S), and
each call is measured with primitives.LEDGER. Every call is filed under a *purpose* ("grad
reduce-scatter", "param all-gather", ...) so comm_report can show bytes per step per collective.

Overlap (overlap_comm): `async_op=True` hands the call to primitives' executor
(primitives.submit: one worker thread per communicator) and returns its Work at once; the
caller computes on, and `wait(work)` blocks only for what is left. While anything is in
flight, synchronous calls queue on that same thread, so every rank still issues its
collectives in program order (they pair up) and the ledger's byte count of each call is its
own (one call runs at a time). The bookkeeping runs with the call, on the thread doing the
work. Each async call leaves an Event: when it was launched, started, finished and waited
for, and how long the wait blocked (the *exposed* communication); comm_report prints them.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import primitives as P
from primitives.engine.cost import ring_bytes   # the one ring byte formula

IMPLS = ("primitives", "torch")
# the ring reduce-scatter receives each block into a buffer its communicator keeps for good
# (primitives' scratch, grown to the largest block): a large unit's reduce runs in pieces of at
# most this many bytes per rank, so that buffer stays this small (same bytes sent, one call per piece)
RS_PIECE_BYTES = 1 << 20


@dataclass
class Usage:
    collective: str
    calls: int = 0
    payload: int = 0          # S summed over calls (bytes of the full buffer)
    formula: int = 0          # bytes a ring sends for that S
    sent: int | None = 0      # measured bytes sent (primitives only)
    seconds: float = 0.0      # wall time inside the calls (comms_logger.py's latency and bandwidths)


@dataclass
class Event:
    """One asynchronous collective, times in seconds since the step began (Comm.reset_step)."""
    purpose: str
    what: str                 # the bucket / module it moved
    nbytes: int
    launched: float
    started: float = float("nan")     # when the worker thread began it (after earlier calls)
    finished: float = float("nan")
    waited: float = float("nan")      # when the caller asked for the result
    exposed: float = 0.0              # how long that wait blocked: communication not hidden


class Comm:
    """group: the torch process group every call runs over (None = the world). With an mpu
    (DeepSpeed's model-parallel unit, see mpu.py) the engine passes the data-parallel group:
    rank and size are then this rank's place in that group, and broadcast's src is a group rank."""

    def __init__(self, impl: str = "primitives", group=None):
        if impl not in IMPLS:
            raise ValueError(f"comm_impl={impl!r} is invalid; allowed: {list(IMPLS)}")
        if not dist.is_initialized():
            raise RuntimeError("zero_from_scratch needs torch.distributed initialised: start with torchrun / "
                               "deepspeed launcher and call primitives.launch.init_from_env() first")
        self.impl, self.group = impl, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        if impl == "primitives":
            self._ledger = P.LEDGER
            ring = dict(algorithm="ring", group=group)
            self._all_reduce = functools.partial(P.all_reduce, **ring)
            self._rs = functools.partial(P.reduce_scatter_single, **ring)
            self._ag = functools.partial(P.all_gather_single, **ring)
            self._bcast = functools.partial(P.broadcast, group=group)
            self._rs_list = functools.partial(P.reduce_scatter, **ring)
        else:
            self._ledger = None
            self._all_reduce = functools.partial(dist.all_reduce, group=group)
            self._rs = functools.partial(dist.reduce_scatter_tensor, group=group)
            self._ag = functools.partial(dist.all_gather_into_tensor, group=group)
            self._bcast = functools.partial(dist.broadcast, group=group)
        self.device = torch.device("cpu")      # where small helper tensors live (the engine sets it)
        self.usage: dict[str, Usage] = {}       # purpose -> usage since reset_step()
        self.last_step: dict[str, Usage] = {}   # the previous optimizer step's usage
        self.events: list[Event] = []           # async calls since reset_step()
        self.last_events: list[Event] = []
        self._inflight: list = []               # async Works not known to be done
        self.t0 = time.perf_counter()

    def reset_step(self) -> None:
        self.last_step, self.usage = self.usage, {}
        self.last_events, self.events = self.events, []
        self.t0 = time.perf_counter()

    def _account(self, purpose: str, collective: str, nbytes: int, fn, formula: int | None = None) -> None:
        u = self.usage.setdefault(purpose, Usage(collective))
        u.calls += 1
        u.payload += nbytes
        u.formula += ring_bytes(collective, nbytes, self.size) if formula is None else formula
        t = time.perf_counter()
        if self._ledger is None:
            fn()
            u.sent = None
        else:
            with self._ledger.track() as d:
                fn()
            u.sent = (u.sent or 0) + d.bytes_sent
        u.seconds += time.perf_counter() - t

    def _run(self, purpose: str, collective: str, nbytes: int, fn, async_op: bool = False, what: str = "",
             formula: int | None = None):
        self._inflight = [w for w in self._inflight if not w.is_completed()]
        if not async_op and not self._inflight:
            self._account(purpose, collective, nbytes, fn, formula)
            return None
        ev = Event(purpose, what, nbytes, time.perf_counter() - self.t0)

        def go():
            ev.started = time.perf_counter() - self.t0
            try:
                self._account(purpose, collective, nbytes, fn, formula)
            finally:
                ev.finished = time.perf_counter() - self.t0
        work = P.submit(self._executor, go, purpose)
        if not async_op:                        # queued behind the in-flight calls: program order
            work.wait()
            return None
        self._inflight.append(work)
        self.events.append(ev)
        work.event = ev                         # the engine's record rides on primitives' handle
        return work

    def wait(self, work, *then) -> None:
        """Wait for an async call (its error re-raised), then run `then` here. How long the first
        wait blocked is the call's exposed communication."""
        t0, first = time.perf_counter(), not work.done
        try:
            work.wait()
        finally:
            if first:
                work.event.waited, work.event.exposed = t0 - self.t0, time.perf_counter() - t0
        for fn in then:
            fn()

    @functools.cached_property
    def _executor(self):
        """Whose worker thread runs the async calls: the primitives communicator of the group, so
        that they queue with every other call on it; with torch, this Comm."""
        return P.get_comm(self.group) if self.impl == "primitives" else self

    def _finish(self, work) -> None:         # a Work of this Comm (impl "torch") holds a Future
        work.handle.result()

    def _completed(self, fut) -> bool:
        return fut.done()

    # The textbook's collective methods (stage1.py), with a ledger label (purpose, what), a tag
    # for the primitives handshake and async_op (a Work comes back; otherwise None).
    def all_reduce(self, t: torch.Tensor, op: str = "sum", *, purpose: str = "all-reduce", async_op: bool = False,
                   what: str = ""):
        assert op == "sum", op
        return self._run(purpose, "all_reduce", t.numel() * t.element_size(), lambda: self._all_reduce(t),
                         async_op, what)

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum", *,
                              purpose: str = "reduce-scatter", tag: int = 0, async_op: bool = False, what: str = ""):
        """out (numel/N) <- this rank's block of the sum of every rank's inp. out may alias inp's block.
        async_op=True: returns a Work (see the module docstring); otherwise None."""
        assert op == "sum", op
        def go():
            if self.impl == "primitives":
                self._rs_pieces(out, inp, tag)
            elif _overlaps(out, inp):
                tmp = torch.empty_like(out)
                self._rs(tmp, inp)
                out.copy_(tmp)
            else:
                self._rs(out, inp)
        return self._run(purpose, "reduce_scatter", inp.numel() * inp.element_size(), go, async_op, what)

    def _rs_pieces(self, out: torch.Tensor, inp: torch.Tensor, tag: int) -> None:
        k, step = out.numel(), max(1, RS_PIECE_BYTES // out.element_size())
        if k <= step or self.size == 1:
            return self._rs(out, inp, tag=tag)
        blocks = inp.reshape(-1).view(self.size, k)
        for a in range(0, k, step):          # out may alias this rank's block: piece a only reads piece a
            self._rs_list(out[a:a + step], list(blocks[:, a:a + step]), tag=tag)

    def call_through(self, call, gather: str = "all_gather_into_tensor") -> None:
        """Each collective from now on is `call(name, *args, **keywords)`, `name` its DeepSpeed name (the runner's
        served deepspeed.comm, as_deepspeed/comm_names.py), so a script's patch of those names sees the engine's
        own calls, as it sees DeepSpeed's stages' (`gather`: the name a parameter gather goes by). The keywords keep this Comm's group, algorithm and tag: the same
        primitives call runs. Cost: one Python call and a context variable (~1 us)."""
        if self.impl != "primitives":
            return
        for attr in ("_all_reduce", "_rs", "_ag", "_bcast", "_rs_list"):
            fn = getattr(self, attr)
            name = DEEPSPEED_NAMES.get(getattr(fn, "func", None))
            name = gather if name == "all_gather_into_tensor" else name
            if name is not None:
                setattr(self, attr, functools.partial(call, name, **fn.keywords))

    @property
    def checks_tags(self) -> bool:
        """True when every collective already verifies a caller tag across ranks (the primitives
        handshake), so callers need no separate consistency round."""
        if self.impl != "primitives":
            return False
        return P.handshake_enabled()

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, *, purpose: str = "all-gather", tag: int = 0,
                          async_op: bool = False, what: str = ""):
        """out (N·numel) <- every rank's inp, rank-major. inp may be out's own block."""
        def go():
            if self.impl == "primitives":
                self._ag(out, inp, tag=tag)
                return
            self._ag(out, inp.clone() if _overlaps(out, inp) else inp)
        return self._run(purpose, "all_gather", out.numel() * out.element_size(), go, async_op, what)

    def composed(self, purpose: str, collective: str, nbytes: int, formula: int, fn, what: str = "",
                 async_op: bool = False):
        """A collective the engine composes itself on a sub-group (ZeRO++ qgZ's all-to-alls, hpZ's
        group all-gather): fn() runs it, filed under `purpose` with the bytes its algorithm sends."""
        return self._run(purpose, collective, nbytes, fn, async_op, what, formula)

    def broadcast(self, t: torch.Tensor, src: int, *, purpose: str = "broadcast") -> None:
        """src is a rank of this Comm's group (both libraries take a global rank)."""
        g = src if self.group is None else dist.get_global_rank(self.group, src)
        self._run(purpose, "broadcast", t.numel() * t.element_size(), lambda: self._bcast(t, g))

    def gather_ints(self, values: list[int], purpose: str = "divergence check") -> list[list[int]]:
        """Every rank's small int list (same length everywhere): a cheap cross-rank consistency check."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.size * len(values), dtype=torch.int64, device=self.device)
        self.all_gather_single(out, mine, purpose=purpose)
        return out.view(self.size, len(values)).tolist()


# primitives' collective -> deepspeed.comm's name for it (DeepSpeed's ZeRO stages call these)
DEEPSPEED_NAMES = {P.all_reduce: "all_reduce", P.reduce_scatter_single: "reduce_scatter_fn",
                   P.reduce_scatter: "reduce_scatter", P.all_gather_single: "all_gather_into_tensor",
                   P.broadcast: "broadcast"}


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def expert_comms(engine) -> dict:
    """group name → the Comm of an MoE expert-data-parallel group (ep_size > 1; moe_params.plan), whose
    collectives the engine resets (reset_all) and reports with its own."""
    return getattr(engine, "expert_comm_of", {})


def reset_all(engine) -> None:
    """reset_step of the engine's Comm and its expert groups' (the experts' init broadcast is not a per-step cost)."""
    engine.comm.reset_step()
    for c in expert_comms(engine).values():
        c.usage.pop("init broadcast (expert data parallel)", None)
        c.reset_step()
