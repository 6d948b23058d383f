"""Communicator: the one small interface every algorithm in ringzero talks through.

    python -m pytest -q tests/test_primitives_collectives.py -k textbook

    rank, size, device                        my place in the group; where my buffers live
    isend / irecv(t, peer) -> Work            non-blocking point-to-point; work.wait()
    send / recv(t, peer)                      the blocking forms
    exchange(sends=[(t, peer)], recvs=[..])   several sends and receives posted as ONE group
    all_reduce, broadcast, all_gather(_single), reduce_scatter(_single), all_to_all_single
                                              each run by an algorithm of primitives/<collective>.py

Peers are group ranks 0..size-1. Empty messages are skipped on both sides (both know the size).

Why groups: nccl runs each ungrouped send/recv on a stream shared by the pair of ranks, in
posting order, and a send completes only once the peer's matching receive runs. If both ranks
post irecv(peer) then isend(peer), each receive sits in front of the send the other needs:
deadlock. A group (dist.batch_isend_irecv) progresses all its operations together. So every
step that both sends to and receives from a peer uses exchange().

The engine (primitives/engine/checked.py) subclasses it: the same algorithms, every message
counted, deadlines that name a dead peer, arguments checked on every rank.
"""
import importlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from primitives.ops import finish_avg_

# algorithm="ring" -> primitives/all_reduce.py::ring. By module path: on the package, the names
# all_reduce, broadcast, ... are the engine's drop-in functions (primitives/__init__.py).
all_reduce, broadcast, all_gather, reduce_scatter, all_to_all = (
    importlib.import_module(f"primitives.{name}")
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"))


class Work:
    """A pending operation: a send, a receive or (in the engine) a whole collective, with
    torch.distributed.Work's interface. `handle` is what the transport posted; the communicator
    finishes it (comm._finish) and says whether it is done (comm._completed). None: done already.
    An error is kept: every later wait() raises it again, exception() returns it."""

    def __init__(self, comm, handle, peer=None, kind="", outputs=()):
        self.comm, self.handle, self.peer, self.kind, self.outputs = comm, handle, peer, kind, outputs
        self.done, self.error = handle is None, None

    def wait(self, timeout=None) -> bool:
        """Block until done (re-raising its error). timeout (seconds or timedelta): RuntimeError
        if not done by then; the operation itself goes on."""
        if timeout is not None and not self.is_completed():
            secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            end = time.monotonic() + secs
            while secs > 0 and not self.is_completed():
                if time.monotonic() > end:
                    raise RuntimeError(f"rank {self.comm.rank}: {self.kind}: Work.wait(timeout={secs:g}s) timed "
                                       f"out; it has not finished (a peer has not joined it yet)")
                time.sleep(0.0005)
        if not self.done:
            try:
                self.comm._finish(self)
            except Exception as e:
                self.error = e
            self.done = True
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done or self.comm._completed(self.handle)

    def exception(self):
        """The error once it finished, else None."""
        if self.is_completed() and not self.done:
            try:
                self.wait()
            except Exception:
                pass
        return self.error

    def is_success(self) -> bool:
        if not self.is_completed():
            raise RuntimeError(f"{self.kind}: is_success() asked before the work completed; call wait() first")
        return self.exception() is None

    def result(self) -> list:
        self.wait()
        return list(self.outputs)

    def get_future(self) -> torch.futures.Future:
        """A torch Future holding the outputs, completed when this work is (waited for here when
        the transport has no callback to complete it later)."""
        fut = torch.futures.Future()

        def complete(*_):
            try:
                fut.set_result(self.result())
            except Exception as e:
                fut.set_exception(e)
        if hasattr(self.handle, "add_done_callback") and not self.done:
            self.handle.add_done_callback(complete)
        else:
            complete()
        return fut


DONE = Work(None, None)   # an empty message, or a collective that already ran


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of t, or a contiguous copy when t is not contiguous."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _copy_back(t: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.copy_(flat.view_as(t))


class Communicator:
    """A backend provides _isend(tensor, peer) and _irecv(tensor, peer), which post an operation
    and return a handle, _wait(handle), which blocks until it is done, and, where its handles
    are not torch Works, _completed(handle)."""
    rank: int
    size: int
    backend: str
    device: torch.device

    def isend(self, tensor: torch.Tensor, peer: int):
        return DONE if tensor.numel() == 0 else Work(self, self._isend(tensor, peer), peer, "sending to")

    def irecv(self, tensor: torch.Tensor, peer: int):
        return DONE if tensor.numel() == 0 else Work(self, self._irecv(tensor, peer), peer, "receiving from")

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.isend(tensor, peer).wait()

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self.irecv(tensor, peer).wait()

    def exchange(self, sends=(), recvs=()) -> list:
        """Post every (tensor, peer) receive and send as one group; returns their Works,
        receives first (in the order given), then sends."""
        ops = [("recv", t, p) for t, p in recvs if t.numel()] + [("send", t, p) for t, p in sends if t.numel()]
        return [Work(self, h, p, "receiving from" if k == "recv" else "sending to")
                for h, (k, _, p) in zip(self._group(ops), ops)] if ops else []

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
        """Swap buffers with one peer (one group) and wait for both directions."""
        for r in self.exchange(sends=[(send, peer)], recvs=[(recv, peer)]):
            r.wait()

    def _finish(self, work) -> None:
        self._wait(work.handle)

    def _completed(self, handle) -> bool:
        return handle.is_completed()

    def _group(self, ops) -> list:
        """Post a group of ("send"|"recv", tensor, peer). Default: one operation at a time, which
        is a group for any transport whose posted operations progress independently (gloo, MPI)."""
        return [self._irecv(t, p) if k == "recv" else self._isend(t, p) for k, t, p in ops]

    def scratch(self, numel: int, dtype, slot: int = 0, device=None) -> torch.Tensor:
        """A reusable buffer per (device, dtype, slot): allocated once and grown, never freed.
        One per communicator, so two groups' collectives running at once never share one."""
        cache = self.__dict__.setdefault("_scratch", {})
        device = self.device if device is None else torch.device(device)
        buf = cache.get((device, dtype, slot))
        if buf is None or buf.numel() < numel:
            buf = cache[(device, dtype, slot)] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return buf[:numel]

    # ---- collectives: in place, ranks are group ranks, op is "sum" | "avg" | "min" | "max" |
    # "product". algorithm= names a function of primitives/<collective>.py. Here every call runs
    # at once, so async_op=True returns a Work that is already done (the engine overlaps).
    def all_reduce(self, tensor, op="sum", *, algorithm="ring", async_op=False, tag=0):
        buf = _flat(tensor)
        if self.size > 1 and buf.numel():
            getattr(all_reduce, algorithm)(self, buf, op)
        finish_avg_(buf, op, self.size)
        _copy_back(tensor, buf)
        return DONE if async_op else None

    def broadcast(self, tensor, src, *, algorithm="tree", async_op=False, tag=0):
        buf = _flat(tensor)
        if self.size > 1 and buf.numel():
            getattr(broadcast, algorithm)(self, buf, src)
        _copy_back(tensor, buf)
        return DONE if async_op else None

    def all_gather(self, tensor_list, tensor, *, algorithm="ring", async_op=False, tag=0):
        blocks = [_flat(t) for t in tensor_list]
        blocks[self.rank].copy_(tensor.reshape(-1))
        if self.size > 1 and tensor.numel():
            getattr(all_gather, algorithm)(self, blocks)
        for t, b in zip(tensor_list, blocks):
            _copy_back(t, b)
        return DONE if async_op else None

    def all_gather_single(self, output, input, *, algorithm="ring", async_op=False, tag=0):
        out = _flat(output)
        self.all_gather(list(out.tensor_split(self.size)), input, algorithm=algorithm)
        _copy_back(output, out)
        return DONE if async_op else None

    def reduce_scatter(self, output, input_list, op="sum", *, algorithm="ring", async_op=False, tag=0):
        out = _flat(output)
        blocks = [_flat(t) for t in input_list]
        if self.size == 1 or out.numel() == 0:
            out.copy_(blocks[self.rank])
        else:
            getattr(reduce_scatter, algorithm)(self, blocks, out, op)
        finish_avg_(out, op, self.size)
        _copy_back(output, out)
        return DONE if async_op else None

    def reduce_scatter_single(self, output, input, op="sum", *, algorithm="ring", async_op=False, tag=0):
        return self.reduce_scatter(output, list(_flat(input).tensor_split(self.size)), op,
                                   algorithm=algorithm, async_op=async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, *,
                          algorithm="pairwise", async_op=False, tag=0):
        """Rows input_split_sizes[p] of input go to rank p; output_split_sizes[p] rows come from
        rank p (None: dim 0 split evenly)."""
        n = self.size
        row = input[0].numel() if input.shape[0] else 0
        ins = input_split_sizes or [input.shape[0] // n] * n
        outs = output_split_sizes or [output.shape[0] // n] * n
        src = _flat(input).clone()                       # output may be input: keep what is still to send
        out = _flat(output)
        send, recv = src.split([s * row for s in ins]), out.split([s * row for s in outs])
        recv[self.rank].copy_(send[self.rank])
        if n > 1:
            getattr(all_to_all, algorithm)(self, send, recv)
        _copy_back(output, out)
        return DONE if async_op else None


class TorchComm(Communicator):
    """torch.distributed point-to-point over gloo (CPU tensors) or nccl (CUDA tensors), in `group`
    (None: the default group). Every wait has a deadline of `timeout` seconds."""

    def __init__(self, group=None, timeout: float = 60.0):
        self.group, self.timeout = group, timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]

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
            raise TimeoutError(f"timed out after {self.timeout:.0f}s")

