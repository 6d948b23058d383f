"""ZeRO-3's saved weights by reference: what makes releasing a unit after forward free it.

    python -m pytest tests/test_zero_stage3.py -x

Autograd saves what backward needs, and for a Linear that is the weight (as W.t()). Saved as a
tensor, it would keep the whole gathered buffer alive from forward to backward, so releasing
after forward would free nothing. Instead, a view of a gathered unit is saved as (unit, shape,
stride, offset) and rebuilt, on first use in backward, from the buffer the backward pre-hook has
gathered again. DeepSpeed gets the same effect with its own Linear. Cost: a dict lookup per
saved tensor; no communication (a registered external unit missing in backward is re-gathered).

Inside a script's own `GatheredParameters` block the hooks step aside (`suspended`), and what is
saved there is saved as DeepSpeed saves it: a Parameter as the object itself, usable in backward
once the script (or a module's hook) gathers it again. A fused LM-head kernel (TRL's
ChunkedLogProbFunction) reads `lm_head.weight` in such a block, saves it and gathers it again in its
backward; a tensor that went through the hooks would come back as a new tensor holding the data of
the moment of unpacking (empty) and without `ds_status`. The block's gathered buffer stays alive
while a view saved in it does (the pool does not reuse a buffer something still sees), as in DeepSpeed.
Such a kernel tests `ds_status` before it gathers, so the status follows every gather and release
(add / remove); and a unit it gathers in backward stays until its gradient is reduced (grad_due).
"""
from __future__ import annotations

import contextlib

import torch

from zero_from_scratch.engine.zero_partition import ZeroParamStatus


class _SavedView:
    """Marker: a saved tensor that is a view of a gathered parameter unit (see pack)."""


class SavedByReference:
    """stage: the ZeroStage3 whose gathered buffers (`full_of`) views are rebuilt from.
    regather: unit index -> Unit gathered again on demand when its buffer is gone (external.py)."""

    def __init__(self, stage):
        self.stage = stage
        self.unit_of_storage: dict[int, int] = {}         # gathered buffer's storage pointer -> unit
        self.regather: dict = {}
        self.late: set[int] = set()                       # units kept past a script's block for their gradient
        self.script_read: set[int] = set()                # persistent units a script's blocks gather (a fused head)

    def add(self, index: int, full: torch.Tensor) -> None:
        """Unit `index` is gathered into `full` (its parameters' ds_status follows, as DeepSpeed's does)."""
        self.unit_of_storage[full.untyped_storage().data_ptr()] = index
        self._status(index, ZeroParamStatus.AVAILABLE)

    def remove(self, full: torch.Tensor) -> None:
        index = self.unit_of_storage.pop(full.untyped_storage().data_ptr(), None)
        if index is not None:
            self._status(index, ZeroParamStatus.NOT_AVAILABLE)

    def _status(self, index: int, status) -> None:
        for s in self.stage.unit(index).slots:
            p = self.stage.params[s.name]
            if hasattr(p, "ds_status"):      # set by zero_partition.adopt; scripts test it before gathering
                p.ds_status = status

    def grad_due(self, u) -> bool:
        """In backward, before u's gradient has arrived: a script's own gather (a fused kernel's
        GatheredParameters in its backward) keeps u until the reduce, as DeepSpeed keeps it until the
        module's backward ends; autograd accumulates the gradient into the parameter after the block,
        which needs the full shape."""
        due = torch._C._current_graph_task_id() != -1 and self.stage.pending.get(u.index, -1) > 0
        if due:
            self.late.add(u.index)
        return due

    @staticmethod
    def recomputed(kind: str) -> bool:
        """A forward inside backward (activation checkpointing's recompute): the unit stays gathered until
        its reduce or the end of backward (DeepSpeed keeps only frozen ones, its ds_recompute_parameters,
        and gathers a trainable unit again for the block's backward: one all-gather more, the same numbers). What the
        recompute saves may be the Parameter object itself (DeepSpeed's ZeRO-3 Linear), whose shape torch's
        checkpoint compares with the forward's and whose data the block's backward, next, reads."""
        return kind == "forward" and torch._C._current_graph_task_id() != -1

    def released_late(self, u) -> bool:
        """u was kept past a script's block (grad_due): its reduce releases it, persistent or not, as
        DeepSpeed's block releases what it gathered. A persistent unit only a script's blocks read (a
        fused head) is then not gathered when the step comes, so the stage does not gather it again
        after the step, and the script's next block saves the Parameter itself: through saved-tensor
        hooks torch hands back a new tensor (no ds_status) even when pack returns the Parameter."""
        if u.index not in self.late:
            return False
        self.late.discard(u.index)
        self.script_read.add(u.index)                     # nor a step or a save (stage3.gather_persistent)
        return True

    def read_by(self, u, kind: str) -> None:
        """A unit the model's own forward gathers is the stage's again: a step or save gathers it."""
        if kind == "forward":
            self.script_read.discard(u.index)

    @contextlib.contextmanager
    def active(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    @contextlib.contextmanager
    def suspended(self):
        """Inside: tensors are saved plainly (see the module docstring). Only when the innermost
        saved-tensor hooks are this object's (an activation-checkpointing region keeps its own)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        ours = top is not None and top[0] == self.pack
        if ours:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        try:
            yield
        finally:
            if ours:
                torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)

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


@contextlib.contextmanager
def plain_saves():
    """Inside: the engine's hooks, when they are the innermost, step aside (SavedByReference.suspended);
    for a function that saves the Parameter object itself, as DeepSpeed's ZeRO-3 Linear does."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    owner = getattr(top[0], "__self__", None) if top is not None else None
    with owner.suspended() if isinstance(owner, SavedByReference) else contextlib.nullcontext():
        yield
