"""The engine's only door to communication: primitives (default) or torch.distributed.

    engine = zero_from_scratch.initialize(..., comm_impl="primitives" | "torch")

Both libraries share torch's signatures, so the switch is `B = primitives` vs
`B = torch.distributed`. With primitives the ring algorithm is forced so the bytes match the
textbook formulas (reduce-scatter and all-gather send (N-1)/N·S, all-reduce 2(N-1)/N·S), and
each call is measured with primitives.LEDGER. Every call is filed under a *purpose* ("grad
reduce-scatter", "param all-gather", ...) so comm_report can show bytes per step per collective.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from primitives.cost import ring_bytes   # the one ring byte formula

IMPLS = ("primitives", "torch")


@dataclass
class Usage:
    collective: str
    calls: int = 0
    payload: int = 0          # S summed over calls (bytes of the full buffer)
    formula: int = 0          # bytes a ring sends for that S
    sent: int | None = 0      # measured bytes sent (primitives only)


class Comm:
    def __init__(self, impl: str = "primitives"):
        if impl not in IMPLS:
            raise ValueError(f"comm_impl={impl!r} is invalid; allowed: {list(IMPLS)}")
        if not dist.is_initialized():
            raise RuntimeError("zero_from_scratch needs torch.distributed initialised: start with torchrun / "
                               "deepspeed launcher and call primitives.launch.init_from_env() first")
        self.impl = impl
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        if impl == "primitives":
            import primitives as B
            self._ledger = B.LEDGER
            ring = dict(algorithm="ring")
            self._all_reduce = functools.partial(B.all_reduce, **ring)
            self._rs = functools.partial(B.reduce_scatter_single, **ring)
            self._ag = functools.partial(B.all_gather_single, **ring)
            self._bcast = B.broadcast
        else:
            B = dist
            self._ledger = None
            self._all_reduce = B.all_reduce
            self._rs = getattr(B, "reduce_scatter_single", None) or B.reduce_scatter_tensor
            self._ag = getattr(B, "all_gather_single", None) or B.all_gather_into_tensor
            self._bcast = B.broadcast
        self.usage: dict[str, Usage] = {}       # purpose -> usage since reset_step()
        self.last_step: dict[str, Usage] = {}   # the previous optimizer step's usage

    def reset_step(self) -> None:
        self.last_step, self.usage = self.usage, {}

    def _run(self, purpose: str, collective: str, nbytes: int, fn) -> None:
        u = self.usage.setdefault(purpose, Usage(collective))
        u.calls += 1
        u.payload += nbytes
        u.formula += ring_bytes(collective, nbytes, self.size)
        if self._ledger is None:
            fn()
            u.sent = None
            return
        with self._ledger.track() as d:
            fn()
        u.sent = (u.sent or 0) + d.bytes_sent

    def all_reduce(self, t: torch.Tensor, purpose: str) -> None:
        self._run(purpose, "all_reduce", t.numel() * t.element_size(), lambda: self._all_reduce(t))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, purpose: str, tag: int = 0) -> None:
        """out (numel/N) <- this rank's block of the sum of every rank's inp. out may alias inp's block."""
        def go():
            if self.impl == "primitives":
                self._rs(out, inp, tag=tag)
            elif _overlaps(out, inp):
                tmp = torch.empty_like(out)
                self._rs(tmp, inp)
                out.copy_(tmp)
            else:
                self._rs(out, inp)
        self._run(purpose, "reduce_scatter", inp.numel() * inp.element_size(), go)

    @property
    def checks_tags(self) -> bool:
        """True when every collective already verifies a caller tag across ranks (the primitives
        handshake), so callers need no separate consistency round."""
        if self.impl != "primitives":
            return False
        import primitives
        return primitives.handshake_enabled()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, purpose: str, tag: int = 0) -> None:
        """out (N·numel) <- every rank's inp, rank-major. inp may be out's own block."""
        def go():
            if self.impl == "primitives":
                self._ag(out, inp, tag=tag)
                return
            self._ag(out, inp.clone() if _overlaps(out, inp) else inp)
        self._run(purpose, "all_gather", out.numel() * out.element_size(), go)

    def broadcast(self, t: torch.Tensor, src: int, purpose: str) -> None:
        self._run(purpose, "broadcast", t.numel() * t.element_size(), lambda: self._bcast(t, src))

    def gather_ints(self, values: list[int], purpose: str = "divergence check") -> list[list[int]]:
        """Every rank's small int list (same length everywhere): a cheap cross-rank consistency check."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(self.size * len(values), dtype=torch.int64)
        self.all_gather(out, mine, purpose)
        return out.view(self.size, len(values)).tolist()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
