"""The errors the engine raises, in one leaf module every other engine module can import."""
from __future__ import annotations


class PeerError(RuntimeError):
    """A point-to-point transfer or a communicator's set-up failed or timed out; the message
    names this rank, the peer, and the root cause (faults.py).
    dead: the rank a transport *knows* died (shm: its pid is gone; a group rank, which may not be
    the peer this rank was waiting on), or, once attributed, the global rank the root cause names.
    evidence: what the transport saw (faults.PID_GONE, faults.CLOSED, ...).
    attributed: the message already names the root cause; wrappers pass it on unchanged."""

    def __init__(self, *args, dead: int | None = None, evidence: str | None = None, attributed: bool = False):
        super().__init__(*args)
        self.dead, self.evidence, self.attributed = dead, evidence, attributed


class CollectiveError(ValueError):
    """Bad arguments to a collective; raised on every rank of the call."""


class NotInitializedError(RuntimeError):
    """A collective was called before any process group (or MPI world) was set up."""
