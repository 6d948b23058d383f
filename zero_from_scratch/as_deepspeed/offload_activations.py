"""DeepSpeed's CheckpointHiddenStatesOffload (runtime/activation_checkpointing/offload_activations.py).

    offload = CheckpointHiddenStatesOffload()            # under python -m zero_from_scratch.as_deepspeed
    with offload:
        offload.mark(hidden_states)                       # or: an HF GradientCheckpointingLayer marks args[0]
        loss = model(batch).loss; loss.backward()

A saved-tensors hook (torch.autograd.graph.saved_tensors_hooks) that moves the tensors a script
marked — a checkpointed layer's input, its hidden states — to host memory when autograd saves them
and back when backward unpacks them; every other saved tensor passes through. While a manager is
active, transformers' GradientCheckpointingLayer.__call__ is wrapped so that a checkpointing layer
in training marks its first positional argument (when transformers is imported: no such layer exists
before; DeepSpeed imports it on entering, seconds, when installed). As DeepSpeed's:
  skipped (counted, left in place): a tensor not on the accelerator, any tensor when the accelerator
      is a synchronized device (the CPU: hidden states are host memory already), fewer than
      min_offload_bytes, a Parameter or Buffer, an overlapping (stride-0) view;
  keep_last_count   the newest marked tensors stay on the device (the first backward needs them at
      once); an older one goes to the host when a newer one is marked;
  host buffers      dense, keyed by (shape, dtype, layout, pinned), pinned through
      get_accelerator().pin_memory, reused from a pool of max_cpu_buffer_pool_count;
  restore           a fresh device tensor with the saved shape and strides, cached until the manager
      exits (backward(retain_graph=True) unpacks twice).
use_streams: DeepSpeed overlaps the copies with compute on a side stream; here they run on the
compute stream (DeepSpeed's use_streams=False path, its only one on the CPU, which has no streams):
the same values, no overlap; asked on a stream device, warned once. (DeepSpeed's config key
activation_checkpointing.cpu_checkpointing drives the same engine inside its checkpoint(), on stream
devices only: on the CPU that moves nothing either.)
Cost: per offloaded tensor a device→host copy in forward, host→device in backward; frees its bytes between.
"""
from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

from zero_from_scratch.as_deepspeed.accelerator import get_accelerator


@dataclass
class CheckpointActivationOffloadStats:
    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _OffloadedTensorRef:
    tensor_id: int


_TLS = threading.local()           # the active managers of this thread, innermost last
_WARNED: set = set()
_PATCH_LOCK = threading.Lock()
# the GradientCheckpointingLayer marker: its wrapper, the class's own __call__, managers using it, and
# whether a manager installed it (one a script installed itself stays after the managers exit)
_PATCH = {"owned": None, "wrapper": None, "users": 0, "by_context": False}


class _ActivationOffloadEngine:
    """The host copies, the keep-last window and the buffer pool; callers offload_input / restore_input."""

    def __init__(self, use_pin_memory=True, use_streams=True, min_offload_bytes=1024, max_fwd_stash_count=2,
                 max_cpu_buffer_pool_count=64, keep_last_count=1):
        sizes = dict(keep_last_count=keep_last_count, max_fwd_stash_count=max_fwd_stash_count,
                     max_cpu_buffer_pool_count=max_cpu_buffer_pool_count, min_offload_bytes=min_offload_bytes)
        for name, v in sizes.items():
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        self.__dict__.update(sizes, use_pin_memory=use_pin_memory)
        self.stats = CheckpointActivationOffloadStats()
        self._next_id, self._cpu_buffer_pool_count, self._cpu_buffer_pool = 0, 0, {}
        self._tracker: dict = {}        # id → (host buffer, device, shape, stride, buffer key)
        self._fwd_stash: dict = {}      # DeepSpeed's side-stream stash: always empty here (no side stream)
        self._keep_last: dict = {}      # id → the newest marked tensors, still on the device
        self._restored: dict = {}       # id → the restored device tensor (retain_graph unpacks twice)
        self.use_streams = False
        if use_streams and getattr(get_accelerator(), "Stream", None) is not None and "streams" not in _WARNED:
            _WARNED.add("streams")
            warnings.warn("zero_from_scratch: CheckpointHiddenStatesOffload(use_streams=True): the copies run on the "
                          "compute stream (DeepSpeed overlaps them on a side stream): same values, no overlap",
                          stacklevel=3)

    _num_bytes = staticmethod(lambda tensor: tensor.element_size() * tensor.nelement())

    def _offloadable(self, tensor) -> bool:
        """DeepSpeed's device test: never on a synchronized device (the CPU), only accelerator tensors."""
        accel = get_accelerator()
        return not accel.is_synchronized_device() and accel.on_accelerator(tensor)

    def _should_skip(self, tensor) -> bool:
        return (not self._offloadable(tensor) or self._num_bytes(tensor) < self.min_offload_bytes
                or isinstance(tensor, torch.nn.Parameter)
                or (hasattr(torch.nn, "Buffer") and isinstance(tensor, torch.nn.Buffer))
                or (tensor.numel() > 1 and 0 in tensor.stride()))   # restore cannot rebuild an aliased view

    def _buffer_key(self, tensor):
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _pool_cpu_buffer(self, key, buf) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buf)
            self._cpu_buffer_pool_count += 1

    def _empty_cpu_like(self, tensor):
        key = self._buffer_key(tensor)
        pool = self._cpu_buffer_pool.get(key)
        if pool:
            self._cpu_buffer_pool_count -= 1
            return pool.pop(), key
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            host = get_accelerator().pin_memory(host, make_copy=False)
        return host, key

    def _start_offload(self, tensor_id: int, tensor) -> None:
        host, key = self._empty_cpu_like(tensor)
        host.copy_(tensor.detach())
        self._tracker[tensor_id] = (host, tensor.device, tensor.size(), tensor.stride(), key)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += self._num_bytes(host)

    def offload_input(self, tensor):
        """Register a tensor: its id, or None when skipped; the oldest beyond keep_last_count go to the host."""
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        self._keep_last[self._next_id] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._start_offload(oldest, self._keep_last.pop(oldest))
        return self._next_id

    def restore_input(self, tensor_id: int):
        return self._restore_tensor(tensor_id, cache=False)

    def _restore_tensor(self, tensor_id: int, cache: bool = True):
        if cache and tensor_id in self._restored:
            return self._restored[tensor_id]
        kept = self._keep_last.pop(tensor_id, None)
        if kept is not None:
            self.stats.kept_last_tensors += 1
            out = kept
        else:
            tracked = self._tracker.pop(tensor_id, None)
            if tracked is None:
                raise RuntimeError(f"offloaded activation {tensor_id} is no longer tracked. backward() must run "
                                   "before the offload engine is reset.")
            host, device, shape, stride, key = tracked
            out = torch.empty_strided(shape, stride, dtype=host.dtype, device=device)   # offset 0, the saved strides
            out.copy_(host)
            self._pool_cpu_buffer(key, host)
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += self._num_bytes(out)
        if cache:
            self._restored[tensor_id] = out
        return out

    def reset(self) -> None:
        self.stats, self._next_id = CheckpointActivationOffloadStats(), 0
        self._sync_and_clear(pool=False)

    def _sync_and_clear(self, pool: bool = True) -> None:
        for host, *_, key in self._tracker.values() if pool else ():   # never unpacked: back to the pool
            self._pool_cpu_buffer(key, host)
        for d in (self._tracker, self._fwd_stash, self._keep_last, self._restored):
            d.clear()


def _manager_stack() -> list:
    if not hasattr(_TLS, "stack"):
        _TLS.stack = []
    return _TLS.stack


def patch_gradient_checkpointing_layer_marker() -> None:
    """Wrap GradientCheckpointingLayer.__call__: a checkpointing layer in training marks args[0]."""
    if _PATCH["wrapper"] is not None:
        return
    try:
        from transformers import GradientCheckpointingLayer   # lazy: transformers is optional and slow to import
    except ImportError as e:
        raise RuntimeError("patch_gradient_checkpointing_layer_marker requires the `transformers` package "
                           "(>= 4.52, which introduced GradientCheckpointingLayer)") from e
    orig_call = GradientCheckpointingLayer.__call__

    def _checkpoint_offload_call(self, *args, **kwargs):
        stack = _manager_stack()
        manager = stack[-1] if stack else None
        marked = None
        if (manager is not None and self.training and torch.is_grad_enabled()
                and getattr(self, "gradient_checkpointing", False) and args and torch.is_tensor(args[0])):
            manager.mark(args[0])     # only a positional hidden_states is what checkpoint packs
            marked = args[0]
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            if marked is not None:    # id() is recycled: drop a mark the pack hook did not consume
                manager._consume_mark(marked)

    _PATCH["owned"] = GradientCheckpointingLayer.__dict__.get("__call__")
    _PATCH["wrapper"] = GradientCheckpointingLayer.__call__ = _checkpoint_offload_call


def _unpatch_gradient_checkpointing_layer_marker() -> None:
    wrapper, owned = _PATCH["wrapper"], _PATCH["owned"]
    _PATCH["wrapper"] = _PATCH["owned"] = None
    if wrapper is None:
        return
    from transformers import GradientCheckpointingLayer   # loaded already: the wrapper came from it
    if GradientCheckpointingLayer.__call__ is wrapper:     # a later patch by someone else stays
        delattr(GradientCheckpointingLayer, "__call__")
        if owned is not None:
            GradientCheckpointingLayer.__call__ = owned


class CheckpointHiddenStatesOffload(_ActivationOffloadEngine, saved_tensors_hooks):
    """Offload only marked checkpoint inputs (see the module docstring); not re-entrant."""

    def __init__(self, use_pin_memory=True, use_streams=True, min_offload_bytes=1024, max_fwd_stash_count=2,
                 max_cpu_buffer_pool_count=64, keep_last_count=1):
        _ActivationOffloadEngine.__init__(self, use_pin_memory, use_streams, min_offload_bytes, max_fwd_stash_count,
                                          max_cpu_buffer_pool_count, keep_last_count)
        self._allowed: dict = {}      # id(tensor) → marks not yet consumed by a pack
        saved_tensors_hooks.__init__(self, self._pack_tensor, self._unpack_tensor)

    def mark(self, tensor) -> None:
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor) -> bool:
        count = self._allowed.pop(id(tensor), 0)
        if count > 1:
            self._allowed[id(tensor)] = count - 1
        return count > 0

    def _pack_tensor(self, tensor):
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else _OffloadedTensorRef(tensor_id)

    def _unpack_tensor(self, packed):
        return self._restore_tensor(packed.tensor_id) if isinstance(packed, _OffloadedTensorRef) else packed

    def _sync_and_clear(self, pool: bool = True) -> None:    # reset() and __exit__ both drop the marks
        super()._sync_and_clear(pool)
        self._allowed.clear()

    def _pop_manager_stack(self) -> None:
        stack = _manager_stack()
        if self in stack:
            stack.remove(self)
        with _PATCH_LOCK:
            _PATCH["users"] = max(0, _PATCH["users"] - 1)
            if _PATCH["users"] == 0 and _PATCH["by_context"]:
                _unpatch_gradient_checkpointing_layer_marker()
                _PATCH["by_context"] = False

    def __enter__(self):
        if self in _manager_stack():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant; use a separate instance for a "
                               "nested context")
        with _PATCH_LOCK:
            if _PATCH["wrapper"] is None and "transformers" in sys.modules:
                patch_gradient_checkpointing_layer_marker()
                _PATCH["by_context"] = True
            if _PATCH["wrapper"] is not None:
                _PATCH["users"] += 1
        self.reset()
        _manager_stack().append(self)
        try:
            return super().__enter__()
        except Exception:
            self._pop_manager_stack()
            raise

    def __exit__(self, *exc):
        try:
            self._sync_and_clear()
        finally:
            try:
                self._pop_manager_stack()
            finally:
                result = super().__exit__(*exc)
        return result


def get_checkpoint_hidden_states_offloading_ctx_manager(*args, **kwargs) -> CheckpointHiddenStatesOffload:
    return CheckpointHiddenStatesOffload(*args, **kwargs)
