"""Chapter 4's idea: bucket the gradients and all-reduce each bucket while backward goes on.

    torchrun --standalone --nproc_per_node 2 ddp_examples/04_bucketed.py --bucket-cap-mb 0.004
    mpiexec -n 2 python ddp_examples/04_bucketed.py --backend mpi

Backward produces gradients roughly in reverse registration order (last layer first), so
buckets are filled in that order. A post-accumulate-grad hook counts the parameters of a
bucket that are ready; when the bucket is full its all-reduce starts asynchronously
(primitives run it on a background thread; the point-to-point calls release the GIL) and
backward continues with the earlier layers. A final autograd callback, queued by the first
hook, waits for every bucket and divides by N before `loss.backward()` returns, so the usual
`loss.backward(); opt.step()` just works, as with torch's DistributedDataParallel.

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
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

import primitives as P
from ddp_examples.engine.state import sync_initial_state


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
    dp = owner()
    if dp is not None:
        dp._on_grad(i, p)


@dataclass
class _Bucket:
    buffer: torch.Tensor
    params: list                                   # indices into BucketedDataParallel._params
    ready: int = 0                                 # parameters whose gradient arrived this pass
    work: object = None                            # the in-flight all-reduce
    views: dict = field(default_factory=dict)      # param index -> .grad view into buffer


class BucketedDataParallel(nn.Module):
    """Data parallelism with bucketed, overlapped gradient all-reduce.

    BucketedDataParallel(module, bucket_cap_mb=25.0, group=None, comm_impl="primitives", *,
                         algorithm="ring", find_unused_parameters=False, init_sync="broadcast")

    module          wrapped; forward passes straight through; available as `.module`.
    bucket_cap_mb   bucket size in MiB (torch DDP's default 25). Smaller buckets start
                    communicating earlier but pay the per-message latency more often.
    group           a torch process group (None: the default one, or MPI's world).
    comm_impl       "primitives" (our ring, counted by P.LEDGER) or "torch" (the backend's own
                    all_reduce; not on MPI; invisible to the ledger).
    algorithm       primitives all-reduce algorithm; default "ring", so the bytes each rank
                    sends equal 2(N−1)/N·Ψ·e (exactly when each bucket divides by N). "auto"
                    may choose recursive doubling for small buckets, which sends more.
    find_unused_parameters
                    False: a parameter that got no gradient during an optimizer step (its
                    bucket could never fill) raises a RuntimeError naming it, on the ranks where
                    it was unused. True: such parameters count as zero gradients, their buckets
                    are sent at the end of backward (no overlap for them); their .grad becomes
                    the average of the other ranks' contributions (zeros if unused everywhere).
                    Unused sets that differ between ranks need True (or the ranks' calls no
                    longer line up and the others fail with a PeerError after the timeout).
    init_sync       "broadcast" rank 0's parameters and buffers at construction (as torch DDP),
                    "check" (raise before training if any differ) or "none".

    Parameters with requires_grad=False are skipped. Each .grad is a view into its bucket
    (gradient_as_bucket_view): keep it alive with zero_grad(set_to_none=False); if it is set to
    None the hook copies the new gradient in once and re-points .grad. Buffers are broadcast at
    construction only (the chapters' model has none that change).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None, comm_impl: str = "primitives",
                 *, algorithm: str = "ring", find_unused_parameters: bool = False, init_sync: str = "broadcast"):
        super().__init__()
        self.module, self.group = module, group
        self.comm = P.get_comm(group)
        r = self.comm.rank
        if comm_impl not in ("primitives", "torch"):
            raise ValueError(f"rank {r}: BucketedDataParallel: comm_impl must be 'primitives' or 'torch', got {comm_impl!r}")
        if comm_impl == "torch" and self.comm.backend == "mpi":
            raise ValueError(f"rank {r}: BucketedDataParallel: comm_impl='torch' needs a torch.distributed "
                             "backend (gloo/nccl); under mpiexec use comm_impl='primitives'")
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"rank {r}: BucketedDataParallel: bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        self.comm_impl, self.algorithm = comm_impl, algorithm
        self.bucket_cap_mb, self.find_unused_parameters = bucket_cap_mb, find_unused_parameters
        sync_initial_state(module, self.comm, init_sync, type(self).__name__, group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        for n, p in named:      # before touching any .grad, so a refusal leaves the module as it was
            owner = getattr(p, "_ringzero_dp", None)
            if owner is not None and owner() is not None:
                raise ValueError(f"rank {r}: BucketedDataParallel: parameter {n!r} already belongs to another "
                                 "live BucketedDataParallel; call .remove_hooks() on it first (or drop it)")
        plan = plan_buckets([p.numel() * p.element_size() for p in self._params], int(bucket_cap_mb * 2 ** 20),
                            [(p.dtype, p.device) for p in self._params])
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        for bi, idx in enumerate(plan):
            ps = [self._params[i] for i in idx]
            b = _Bucket(torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device), idx)
            off = 0
            for i, p in zip(idx, ps):
                v = b.buffer[off:off + p.numel()].view_as(p)
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v
                b.views[i] = v
                self._bucket_of[i] = bi
                off += p.numel()
            self.buckets.append(b)
        # the hooks hold only a weak reference: a dropped wrapper stops communicating instead of
        # keeping itself alive through its parameters (and double-sending with a new wrapper)
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(self._params)]
        for p in self._params:
            p._ringzero_dp = me
        self.require_backward_grad_sync = True   # flipped by no_sync()
        self._sync_pass = True                   # what the last forward decided
        self._warned = False
        self._reset()

    # ------------------------------------------------------------------ user-facing
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._sync_pass = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside this context sends them."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (after this, backward no longer communicates)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            p._ringzero_dp = None

    def bucket_numels(self) -> list[int]:
        return [b.buffer.numel() for b in self.buckets]

    def bucket_names(self) -> list[list[str]]:
        return [[self._names[i] for i in b.params] for b in self.buckets]

    # ------------------------------------------------------------------ the machinery
    def _reset(self) -> None:
        for b in self.buckets:
            b.ready, b.work = 0, None
        self._next = 0                       # next bucket to launch: always in bucket order,
        self._queued = False                 # so every rank issues the same sequence of calls
        self._seen = [False] * len(self._params)   # got a gradient since the last sync

    @torch.no_grad()
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        b = self.buckets[self._bucket_of[i]]
        v = b.views[i]
        if p.grad is not None and p.grad.data_ptr() != v.data_ptr():   # .grad was set to None
            v.copy_(p.grad)
            p.grad = v
        self._seen[i] = True
        if self.require_backward_grad_sync != self._sync_pass and not self._warned:
            self._warned = True
            warnings.warn("BucketedDataParallel: no_sync() state at backward differs from the forward's; "
                          "like torch DDP the forward decides. Put forward and backward of each "
                          "accumulation micro-batch inside no_sync().", RuntimeWarning, stacklevel=2)
        if not self._sync_pass:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        b.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        if self.comm_impl == "primitives":
            b.work = P.all_reduce(b.buffer, P.ReduceOp.SUM, self.group, async_op=True, algorithm=self.algorithm)
        else:
            b.work = dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @torch.no_grad()
    def _finish(self) -> None:
        """Runs once at the end of a synchronising backward: send what is left, wait, average."""
        try:
            unused = [i for i, s in enumerate(self._seen) if not s]
            if unused and not self.find_unused_parameters:
                self._wait_launched()
                names = [self._names[i] for i in unused]
                raise RuntimeError(
                    f"rank {self.comm.rank}: BucketedDataParallel: parameters {names} received no gradient "
                    "in this optimizer step, so their buckets can never be all-reduced. Pass "
                    "find_unused_parameters=True (they then count as zero gradients), set "
                    "requires_grad=False on them, or make the forward use them.")
            for i in unused:
                self.buckets[self._bucket_of[i]].views[i].zero_()
                self._params[i].grad = self.buckets[self._bucket_of[i]].views[i]
            # buckets whose parameters are unused, or got their gradient in an earlier no_sync pass
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
                self._next += 1
            self._wait_launched()
            n = self.comm.size
            for b in self.buckets:
                b.buffer.div_(n)
        finally:
            self._reset()

    def _wait_launched(self) -> None:
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
