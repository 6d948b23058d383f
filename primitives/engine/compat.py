"""torch.distributed's conventions around the checked calls (api.py): the Work an async call
returns, ranks outside the group, and complex tensors.

    work = primitives.all_reduce(t, async_op=True)
    work.wait(timeout=timedelta(seconds=5)); work.get_future().wait(); work.exception()

Cost: nothing on the data path. Work.wait(timeout) polls the call's completion every 0.5 ms;
get_future() starts one helper thread per call that asks for it.

Complex tensors travel as their real view (torch.view_as_real: a trailing dim of 2), like
torch.distributed does: every collective moves them; the reducing ones accept SUM and AVG,
which act on real and imaginary parts separately (torch's supports_complex refuses the rest).
"""
from __future__ import annotations

import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from primitives.comm import Communicator

COMPLEX_OPS = ("sum", "avg")


def outside(group, name: str) -> bool:
    """True, after torch's warning, when this process is not in `group` (torch then returns None
    without communicating)."""
    if group is None or isinstance(group, Communicator) or not dist.is_initialized():
        return False
    if group is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(group, dist.ProcessGroup)
                                                      and dist.get_rank(group) < 0):
        warnings.warn(f"Running {name} on global rank {dist.get_rank()} which does not belong to the given group.",
                      stacklevel=3)
        return True
    return False


def real(t):
    """A complex tensor's real view (trailing dim of 2); anything else unchanged."""
    return torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() else t


def reals(ts):
    return [real(t) for t in ts] if isinstance(ts, (list, tuple)) else ts


def complex_op(name: str, op, tensors, op_name, torch_name: str | None = None) -> None:
    """torch's rule: a reducing call on complex tensors takes SUM or AVG only (torch_name: the
    call torch's message names, e.g. all_reduce for all_reduce_coalesced)."""
    flat = [x for t in tensors for x in (t if isinstance(t, (list, tuple)) else [t])]
    if any(isinstance(t, torch.Tensor) and t.is_complex() for t in flat) and op_name(op) not in COMPLEX_OPS:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"rank {rank}: {torch_name or name} does not support {op} on complex tensors "
                         f"(in {name}: SUM and AVG act on real and imaginary parts; the others are not defined)")


def _seconds(timeout) -> float | None:
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return None if s <= 0 else s


class Work:
    """What async_op=True returns, with torch.distributed.Work's interface: wait(timeout),
    is_completed(), is_success(), exception(), result() and get_future().

    inner: the engine's asynchronous call (None: it already ran); outputs: the tensors the
    call writes (what result() and the future hold); then(): runs once after the call, before
    wait() returns (e.g. copying a coalesced buffer back)."""

    def __init__(self, inner, outputs, name: str, then=None):
        self.inner, self.outputs, self.name, self._then = inner, list(outputs), name, then
        self._lock = threading.Lock()
        self._done, self._error, self._future = False, None, None

    def is_completed(self) -> bool:
        return self._done or self.inner is None or self.inner.is_completed()

    def _finish(self) -> None:
        with self._lock:
            if self._done:
                return
            try:
                if self.inner is not None:
                    self.inner.wait()
                if self._then is not None:
                    self._then()
            except Exception as e:                   # kept for exception(); wait() re-raises it
                self._error = e
            self._done = True

    def wait(self, timeout=None) -> bool:
        """Block until the call finished (re-raising its error). timeout (timedelta or seconds):
        raise RuntimeError if it has not finished by then; the call itself keeps running on the
        communicator's worker thread, so the group is unusable until it ends (as after a gloo timeout)."""
        secs = _seconds(timeout)
        if secs is not None:
            deadline = time.monotonic() + secs
            while not self.is_completed():
                if time.monotonic() > deadline:
                    rank = dist.get_rank() if dist.is_initialized() else 0
                    raise RuntimeError(f"rank {rank}: {self.name}: Work.wait(timeout={secs:g}s) timed out; "
                                       f"the collective has not finished (a peer has not joined it yet)")
                time.sleep(0.0005)
        self._finish()
        if self._error is not None:
            raise self._error
        return True

    def exception(self):
        """The call's error once it finished, else None."""
        if not self.is_completed():
            return None
        self._finish()
        return self._error

    def is_success(self) -> bool:
        if not self.is_completed():
            raise RuntimeError(f"{self.name}: is_success() asked before the work completed; call wait() first")
        return self.exception() is None

    def result(self) -> list:
        self.wait()
        return self.outputs

    def get_future(self) -> torch.futures.Future:
        """A torch.futures.Future holding the output tensors (as torch's Work.get_future)."""
        if self._future is None:
            fut = self._future = torch.futures.Future()

            def complete():
                try:
                    self.wait()
                    fut.set_result(self.outputs)
                except Exception as e:
                    fut.set_exception(e)
            if self.is_completed():
                complete()
            else:
                threading.Thread(target=complete, daemon=True, name=f"ringzero-future-{self.name}").start()
        return self._future


def work(result, outputs, name: str, async_op: bool, then=None):
    """The engine call's result as torch returns it: None for a blocking call, else a Work."""
    if not async_op:
        if then is not None:
            then()
        return None
    return Work(result, outputs, name, then)
