"""Chapter 4's idea: bucket the gradients and all-reduce each bucket while backward goes on.

    torchrun --standalone --nproc_per_node 2 ddp_examples/04_bucketed.py --bucket-cap-mb 0.004
    mpiexec -n 2 python ddp_examples/04_bucketed.py --backend mpi

Backward produces gradients roughly in reverse registration order (last layer first), so
buckets (each a flat.GradBuffer) are filled in that order. A post-accumulate-grad hook counts
the parameters of a bucket that are ready; when the bucket is full its all-reduce starts
(`comm.all_reduce(..., async_op=True)`: the engine's communicator runs it on a worker thread,
a plain one may finish it at once) and backward continues with the earlier layers. A final
autograd callback, queued by the first hook, waits for every bucket before `loss.backward()`
returns, so the usual `loss.backward(); opt.step()` just works, as with torch's DDP.

Cost per optimizer step and rank (ring): Σ_buckets 2(N−1)/N·|bucket|·e = 2(N−1)/N·Ψ·e bytes in
2(N−1)·(number of buckets) messages. Time ≈ backward + the all-reduce of the *last* bucket,
instead of backward + the all-reduce of everything (chapter 3), when communication keeps up.

Gradient accumulation: inside `with model.no_sync():` nothing is communicated; gradients pile
up in the buckets and the first backward outside it sends them once. Like torch DDP, the
*forward* decides: run forward and backward of each accumulation micro-batch inside no_sync().
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.nn as nn

from ddp_examples.flat import GradBuffer


def plan_buckets(sizes: list[int], cap_bytes: int, keys: list | None = None) -> list[list[int]]:
    """Group parameter indices into buckets, in reverse order (the order backward produces
    gradients). A bucket closes when adding the next parameter would pass `cap_bytes` or when
    the key (dtype, device) changes; a parameter larger than the cap gets a bucket of its own.
    Pure function: sizes[i] is parameter i's gradient size in bytes."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    keys = keys if keys is not None else [None] * len(sizes)
    buckets, cur, cur_bytes, cur_key = [], [], 0, None
    for i in reversed(range(len(sizes))):
        if cur and (cur_bytes + sizes[i] > cap_bytes or keys[i] != cur_key):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += sizes[i]
        cur_key = keys[i]
    if cur:
        buckets.append(cur)
    return buckets


def _hook(owner: weakref.ref, i: int, p: torch.Tensor) -> None:
    dp = owner()         # a weak reference: a dropped wrapper stops communicating
    if dp is not None:
        dp._on_grad(i)


class BucketedDataParallel(nn.Module):
    """Data parallelism with bucketed, overlapped gradient all-reduce.

    module          wrapped; forward passes straight through; available as `.module`.
    comm            the data-parallel communicator (all_reduce with async_op=True).
    bucket_cap_mb   bucket size in MiB (torch DDP's default 25). Smaller buckets start
                    communicating earlier but pay the per-message latency more often.
    algorithm       the all-reduce algorithm; default "ring" (bytes = 2(N−1)/N·Ψ·e).
    find_unused_parameters
                    False: a parameter that got no gradient during an optimizer step (its
                    bucket could never fill) raises a RuntimeError naming it. True: such
                    parameters count as zero gradients and their buckets are sent at the end
                    of backward. Unused sets that differ between ranks need True.
    Parameters with requires_grad=False are skipped. Each .grad is a view into its bucket;
    keep it alive with zero_grad(set_to_none=False) (if set to None it is copied in once).
    """

    def __init__(self, module: nn.Module, comm, bucket_cap_mb: float = 25.0, *, algorithm: str = "ring",
                 find_unused_parameters: bool = False):
        super().__init__()
        self.module, self.comm, self.algorithm = module, comm, algorithm
        self.bucket_cap_mb, self.find_unused_parameters = bucket_cap_mb, find_unused_parameters
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        plan = plan_buckets([p.numel() * p.element_size() for p in self._params], int(bucket_cap_mb * 2 ** 20),
                            [(p.dtype, p.device) for p in self._params])
        self.buckets = [GradBuffer([self._params[i] for i in idx]) for idx in plan]
        self._where = {i: (b, j) for b, idx in enumerate(plan) for j, i in enumerate(idx)}
        self._plan = plan
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(self._params)]
        self.require_backward_grad_sync = True   # flipped by no_sync()
        self._sync_pass = True                   # what the last forward decided
        self._reset()

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._sync_pass = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside this context sends them."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def bucket_numels(self) -> list[int]:
        return [b.buffer.numel() for b in self.buckets]

    def bucket_names(self) -> list[list[str]]:
        return [[self._names[i] for i in idx] for idx in self._plan]

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)     # parameters whose gradient arrived this pass
        self._work = [None] * len(self.buckets)   # in-flight all-reduces
        self._next = 0                            # next bucket to launch, always in bucket order,
        self._queued = False                      # so every rank issues the same sequence of calls
        self._seen = [False] * len(self._params)  # got a gradient since the last sync

    @torch.no_grad()
    def _on_grad(self, i: int) -> None:
        b, j = self._where[i]
        self.buckets[b].repoint(j)                # .grad may have been set to None
        self._seen[i] = True
        if not self._sync_pass:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self._plan[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        self._work[b] = self.comm.all_reduce(self.buckets[b].buffer, "avg", async_op=True, algorithm=self.algorithm)

    @torch.no_grad()
    def _finish(self) -> None:
        """Runs once at the end of a synchronising backward: send what is left, wait."""
        try:
            unused = [i for i, s in enumerate(self._seen) if not s]
            if unused and not self.find_unused_parameters:
                self._wait()
                raise RuntimeError(
                    f"rank {self.comm.rank}: BucketedDataParallel: parameters {[self._names[i] for i in unused]} "
                    "received no gradient in this optimizer step, so their buckets can never be all-reduced. "
                    "Pass find_unused_parameters=True (they then count as zero gradients), set "
                    "requires_grad=False on them, or make the forward use them.")
            for i in unused:
                self._params[i].grad = None
                self.buckets[self._where[i][0]].repoint(self._where[i][1])   # a zero gradient
            while self._next < len(self.buckets):   # unused buckets, or filled in a no_sync pass
                self._launch(self._next)
                self._next += 1
            self._wait()
        finally:
            self._reset()

    def _wait(self) -> None:
        for b, w in enumerate(self._work):
            if w is not None:
                w.wait()
                self._work[b] = None
