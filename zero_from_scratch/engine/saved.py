"""ZeRO-3's saved weights by reference: what makes releasing a unit after forward free it.

    python -m pytest tests/test_zero_stage3.py -x

Autograd saves what backward needs, and for a Linear that is the weight (as W.t()). Saved as a
tensor, it would keep the whole gathered buffer alive from forward to backward, so releasing
after forward would free nothing. Instead, a view of a gathered unit is saved as (unit, shape,
stride, offset) and rebuilt, on first use in backward, from the buffer the backward pre-hook has
gathered again. DeepSpeed gets the same effect with its own Linear. Cost: a dict lookup per
saved tensor; no communication (a registered external unit missing in backward is re-gathered).
"""
from __future__ import annotations

import contextlib

import torch


class _SavedView:
    """Marker: a saved tensor that is a view of a gathered parameter unit (see pack)."""


class SavedByReference:
    """stage: the ZeroStage3 whose gathered buffers (`full_of`) views are rebuilt from.
    regather: unit index -> Unit gathered again on demand when its buffer is gone (external.py)."""

    def __init__(self, stage):
        self.stage = stage
        self.unit_of_storage: dict[int, int] = {}         # gathered buffer's storage pointer -> unit
        self.regather: dict = {}

    def add(self, index: int, full: torch.Tensor) -> None:
        self.unit_of_storage[full.untyped_storage().data_ptr()] = index

    def remove(self, full: torch.Tensor) -> None:
        self.unit_of_storage.pop(full.untyped_storage().data_ptr(), None)

    @contextlib.contextmanager
    def active(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.layout != torch.strided:
            return t
        idx = self.unit_of_storage.get(t.untyped_storage().data_ptr())
        if idx is None:
            return t
        return (_SavedView, idx, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad)

    def unpack(self, x):
        if not (isinstance(x, tuple) and x and x[0] is _SavedView):
            return x
        _, idx, shape, stride, offset, _ = x
        st = self.stage
        if idx not in st.full_of and idx in self.regather:
            u = self.regather[idx]
            st._gather(u, "backward", f"backward use of {u.tag!r} (external)")
        full = st.full_of.get(idx)
        if full is None:
            raise RuntimeError(f"rank {st.rank}: ZeRO-3 needs the parameters of {st.tag_of.get(idx, idx)!r} in "
                               "backward but they are not gathered (was the module's output used after its "
                               "backward hook could run?)")
        return full.as_strided(shape, stride, offset)
