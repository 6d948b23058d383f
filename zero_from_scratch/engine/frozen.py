"""Frozen parameters (requires_grad=False) under ZeRO, as DeepSpeed handles them.

    torchrun --standalone --nproc_per_node 2 -m pytest -q tests/test_recipes_lora.py   (via spawn)

A frozen parameter never enters the optimizer: no gradient buffer, no fp32 master, no Adam
state (that is what makes LoRA cheap). Where it lives depends on the stage:
  stages 0-2  full on every rank, untouched by the engine            b·Ψ_frozen bytes per rank
  stage 3     partitioned like a trainable parameter: one unit per module, a shard of Ψ/N
              elements per rank, gathered by the same module hooks   b·Ψ_frozen/N bytes per rank
Cost at stage 3: an all-gather of the module's frozen unit before its forward, and again before
its backward when autograd needs it (a frozen Linear in the middle of the network must still
pass gradients to its input): 2(N-1)/N·b·Ψ_frozen per micro-batch; nothing is reduced.

The frozen units extend stage 3's machinery instead of copying it: each gets a unit index after
the trainable ones and a parameter group of its own (after the optimizer's groups), so
Stage3._gather / _release, the divergence tags and the saved-weights-by-reference trick apply
unchanged; the optimizer, the gradient norm and the checkpoint's sharded part never see them
(checkpoints store frozen tensors in full, as extras, gathered around save/load).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn

from zero_from_scratch.engine import z3_outputs, zero_partition as zp
from zero_from_scratch.sharding import shard_layout


def _shape(p) -> torch.Size:
    return p.ds_shape if zp.held_by_init(p) else p.shape


def frozen_named(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every frozen parameter, each shared parameter once."""
    return [(n, p) for n, p in module.named_parameters() if not p.requires_grad]


class FrozenParams:
    """The frozen part of one engine's model. At stages 0-2 only bookkeeping; at stage 3 the
    shards, the hooks, and full views for checkpoints and gathered_parameters."""

    def __init__(self, engine):
        self.e = engine
        self.named = frozen_named(engine.module)
        self.numel = sum(_shape(p).numel() for _, p in self.named)
        self.units: list = []
        self.hooks: list = []
        if engine.stage_id == 3 and self.named:
            self._partition()

    # ------------------------------------------------------------------ stage 3
    def _partition(self) -> None:
        e, st, c = self.e, self.e.stage, self.e.comm
        by_id = {id(p): n for n, p in self.named}
        units, taken = [], set()
        for mname, m in e.module.named_modules():
            ps = [(by_id[id(p)], tuple(_shape(p))) for p in m.parameters(recurse=False)
                  if id(p) in by_id and by_id[id(p)] not in taken]
            taken.update(n for n, _ in ps)
            if ps:
                units.append((0, f"{mname or '<root>'} (frozen)", ps))
        lay = shard_layout(units, c.size)
        base, group = len(e.layout.units), len(st.pshard)
        self.units = [dataclasses.replace(u, index=base + u.index, group=group) for u in lay.units]
        shard = torch.zeros(lay.group_local[0] if lay.group_local else 0, dtype=e.dtype)
        st.pshard.append(shard)                          # param_shard(u) finds it by u.group
        st.params = {**st.params, **dict(self.named)}    # engine.params_by_name stays trainable-only
        for u in self.units:                             # the stage's blocks: rank 0's values, or zero.Init's shards
            st.param_shard(u).copy_(st._unit_block(u))
            st.tag_of[u.index] = u.tag
        zp.adopt(e, self.units, st.params, stage=st if getattr(st, "poff", None) is None else None)   # z3_ds_tensor.py
        # DeepSpeed keeps every small parameter gathered, frozen ones too (mark_persistent_parameters)
        st.persistent |= {u.index for u in self.units if u.numel <= e.config.zero.stage3_param_persistence_threshold}
        unit_of = {id(dict(self.named)[s.name]): u for u in self.units for s in u.slots}
        for name, m in e.module.named_modules():
            us = sorted({unit_of[id(p)].index for p in m.parameters(recurse=False) if id(p) in unit_of})
            if not us:
                continue
            self.hook_module(name, m, [self.units[i - base] for i in us])

    def hook_module(self, name: str, m, us: list) -> None:
        """Gather `us` around m's forward and backward (a ZeRO-3 leaf: its whole subtree's, leaf.py)."""
        st = self.e.stage
        # backward hooks on the outputs and inputs, as the trainable units' (z3_outputs.py): torch's full
        # backward hooks would re-wrap the outputs, and a frozen parameter returned would lose its alias
        hs = [m.register_forward_pre_hook(st._pre_forward(name, us)), m.register_forward_hook(st._post_forward(us)),
              m.register_forward_hook(z3_outputs.before_backward(st._pre_backward(name, us))),
              m.register_forward_pre_hook(z3_outputs.after_backward(self._post_backward(us)))]
        self.hooks += hs
        st.hooks += hs            # the stage's too: engine.destroy and unwrap_model_for_generation take them off

    def _post_backward(self, units):
        def hook(module, grad_input):
            # No input needed a gradient: the hook never fires; after_backward releases them instead.
            if any(g is not None for g in grad_input):
                for u in units:
                    self.e.stage._release(u, "backward")
        return hook

    def after_backward(self) -> None:
        for u in self.units:
            self.e.stage._release(u, "backward")

    @contextlib.contextmanager
    def gathered(self, params, modifier_rank=None, release: str = "gather_ctx"):
        """Full frozen tensors among `params` inside the block (stage 3; all ranks enter it).
        With modifier_rank, that rank's values are broadcast and written back into the shards.
        A script's block releases what it gathered, persistent or not, as DeepSpeed's (saved.py); the
        engine's own (a checkpoint's, release="frozen gathered") leaves persistent units gathered."""
        st = self.e.stage
        wanted = {id(p) for p in params}
        units = [u for u in self.units if any(id(st.params[s.name]) in wanted for s in u.slots)]
        mine = [u for u in units if u.index not in st.full_of]
        for u in mine:
            st._gather(u, "gather_ctx", f"gathered_parameters({u.tag!r})")
        try:
            yield
        finally:
            for u in units if modifier_rank is not None else []:   # already-gathered (persistent) ones too
                st.full_of[u.index].copy_(st.write_back(u, modifier_rank))   # a unit that stays holds the edit
            for u in mine:
                st._release(u, release)
            if mine and release == "gather_ctx":              # a step or save leaves them to the script too
                st.saved.script_read.update(u.index for u in mine if u.index in st.persistent)

    def full(self, write_back: bool = False):
        """Every frozen tensor full inside the block: checkpoint save reads them, load writes them
        (write_back: every rank loaded the same values, so each copies its own shard back)."""
        if not self.units:
            return contextlib.nullcontext()
        return self.gathered([p for _, p in self.named], 0 if write_back else None, release="frozen gathered")

    # ------------------------------------------------------------------ memory
    def bytes_per_rank(self) -> int:
        if self.units:
            return sum(u.shard for u in self.units) * self.e.dtype.itemsize
        return sum(p.numel() * p.element_size() for _, p in self.named)

    def report(self) -> dict:
        """Ψ trainable vs Ψ frozen, and the frozen tensors' bytes on this rank (not model states)."""
        return {"trainable_psi": self.e.layout.numel, "frozen_psi": self.numel,
                "frozen_bytes": self.bytes_per_rank(), "frozen_partitioned": bool(self.units)}
