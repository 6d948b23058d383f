"""The errors the engine raises, in one leaf module every other engine module can import."""
from __future__ import annotations


class PeerError(RuntimeError):
    """A point-to-point transfer failed or timed out; the message names both ranks.
    dead: the group rank a transport *knows* died (shm: its pid is gone), which may not be the
    peer this rank was waiting on; the root cause (faults.py) then names it, not the peer."""

    def __init__(self, *args, dead: int | None = None):
        super().__init__(*args)
        self.dead = dead


class CollectiveError(ValueError):
    """Bad arguments to a collective; raised on every rank of the call."""


class NotInitializedError(RuntimeError):
    """A collective was called before any process group (or MPI world) was set up."""
