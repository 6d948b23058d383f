"""Rank-aware printing: print0 on rank 0 only (llm.c's printf0), rprint with a rank prefix."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist
from rich.console import Console

# Piped output (CI, tests, torchrun's log capture) would get rich's 80-column default and
# squeeze tables into unreadable cells; use a wide fixed width there.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def rank() -> int:
    """This process's global rank: the process group's, else the launcher's (mpiexec sets PMI_RANK
    or OMPI_COMM_WORLD_RANK, also for --backend mpi), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0))))


def is_rank0() -> bool:
    return rank() == 0


def print0(*objects, **kwargs) -> None:
    """Print (text or rich renderables such as tables) on rank 0 only."""
    if is_rank0():
        console.print(*objects, **kwargs)


def rprint(*objects, **kwargs) -> None:
    """Print on every rank with a `[rank r]` prefix: for output that is per-rank by design."""
    console.print(f"[bold]\\[rank {rank()}][/bold]", *objects, **kwargs)   # \[ : a literal bracket, not a style tag


def fail(message: str, code: int = 2):
    """Exit with `message` on stderr as ONE write: under a launcher every rank writes to the same
    stream, and SystemExit's own printing (text, then a newline, separately) lets two ranks'
    messages run together on one line."""
    os.write(2, (message.rstrip("\n") + "\n").encode())
    raise SystemExit(code)
