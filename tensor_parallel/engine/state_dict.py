"""The unsharded state dict of a parallelized model, and back.

    python -m pytest -q tests/test_tensor_parallel.py -k mlp

gather_state_dict(model) all-gathers every sharded tensor (uneven.pad_gather) along its `tp_shard`
dim: the unsharded model's state dict on every rank (collective over the tp group);
load_full_state_dict(model, sd) narrows each to this rank's slice (local); sharded_numel(model).
Cost of gather_state_dict: one all-gather per sharded tensor, (N−1)/N of its padded size per rank.
"""
from __future__ import annotations

from torch import nn

from tensor_parallel.engine.uneven import pad_gather
from tensor_parallel.layers import TPError


def gather_state_dict(model: nn.Module) -> dict:
    """The full (unsharded) state dict, on every rank. Collective: every rank of the group calls it."""
    comm = getattr(model, "tp_comm", None)
    if comm is None:
        raise TPError("gather_state_dict: this model was not parallelized (call tensor_parallel.parallelize first)")
    shards = {name: (*p.tp_shard, p.tp_unit) for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    out = {}
    for name, t in model.state_dict().items():
        if name in shards:
            dim, _, _, full, unit = shards[name]
            t = pad_gather(t.detach().movedim(dim, -1), full, comm, unit).movedim(-1, dim).contiguous()
        out[name] = t.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict) -> None:
    """The inverse of gather_state_dict: load an unsharded state dict (a save_pretrained
    checkpoint) into a parallelized model, each sharded tensor narrowed to this rank's slice.
    Local: no communication (every rank reads the full tensors)."""
    if getattr(model, "tp_comm", None) is None:
        raise TPError("load_full_state_dict: this model was not parallelized (call tensor_parallel.parallelize first)")
    shards = {name: p.tp_shard for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    local = {}
    for name, t in state_dict.items():
        if name in shards:
            dim, lo, hi, full = shards[name]
            if t.shape[dim] != full:
                raise TPError(f"load_full_state_dict: {name} has {t.shape[dim]} rows along dim {dim}, the "
                              f"unsharded model has {full}")
            t = t.narrow(dim, lo, hi - lo)
        local[name] = t
    model.load_state_dict(local)


def sharded_numel(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the unsharded model)."""
    local = full = 0
    for p in model.parameters():
        local += p.numel()
        full += p.numel() // (p.tp_shard[2] - p.tp_shard[1]) * p.tp_shard[3] if hasattr(p, "tp_shard") else p.numel()
    return local, full
