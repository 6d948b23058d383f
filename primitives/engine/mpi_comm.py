"""MPIComm: the checked Communicator over mpi4py (torch wheels ship no MPI backend).

    mpiexec -n 4 python primitives/allreduce.py --backend mpi
"""
from __future__ import annotations

import time

import torch

from primitives.engine.checked import DEFAULT_TIMEOUT
from primitives.engine.comms import Collectives
from primitives.engine.errors import PeerError


class MPIComm(Collectives):
    """mpi4py point-to-point on CPU tensors, sent as raw bytes (so bf16/fp16 travel too)."""

    def __init__(self, mpi_comm=None, timeout: float | None = None):
        from mpi4py import MPI   # optional dependency: only `--backend mpi` needs it
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

    def _completed(self, req) -> bool:
        return bool(req.Test()) if hasattr(req, "Test") else super()._completed(req)   # else: an async collective

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
