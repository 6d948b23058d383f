"""The pieces a PipelineModule is made of: layer specs, the tied-layer wrapper, one stage's chunk.

    (used by pipeline_parallel/engine/module.py; LayerSpec / TiedLayerSpec are DeepSpeed's names)

LayerSpec(typename, *args, **kwargs): a layer built only on the stage that owns it; TiedLayerSpec(key,
…): one module shared by every position with that key. StageChunk runs layers start … stop−1 of one
(virtual) stage, optionally in groups of k under activation checkpointing (DeepSpeed's rule: a group
is checkpointed when a layer has parameters, or, with checkpointable_layers, when all its classes are
listed). TiedWeights keeps a tied module's copies on different stages equal: the first holder sends
its weights at start-up (as DeepSpeed's broadcast); after every backward the holders exchange the
tied attributes' gradients (tied_weight_attr, default "weight") as one group on the pipeline
Communicator (exchange: no extra process group, no per-peer order for nccl to deadlock on) and sum
them in stage order, bit for bit equal on every holder; copies after the first holder are skipped by
the norm (`is_replica`, DeepSpeed's ds_pipe_replicated).
Cost: building is local; a checkpointed group keeps only its input and recomputes in backward; per
step per tied holder (k − 1)·Ψ_tied elements sent, k holders.
"""
from __future__ import annotations

from operator import attrgetter

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class PartitionError(ValueError):
    """A partition that leaves a stage empty, or more stages than layers."""


def check_partition(parts: list[int], num_layers: int, what: str = "stage") -> None:
    """Boundaries must start at 0, end at num_layers, and give every stage at least one layer."""
    if not parts or parts[0] != 0 or parts[-1] != num_layers or any(b < a for a, b in zip(parts, parts[1:])):
        raise PartitionError(f"partition {parts} is not a list of boundaries 0 = p0 <= p1 <= … = {num_layers} "
                             f"(the number of layers)")
    empty = [s for s in range(len(parts) - 1) if parts[s + 1] == parts[s]]
    if empty:
        k = len(parts) - 1
        hint = (f"{k} {what}s but only {num_layers} layers" if k > num_layers
                else "move a layer into it or use partition_method='uniform'")
        raise PartitionError(f"partition {parts} leaves {what}(s) {empty} empty ({hint}); "
                             f"every {what} needs at least one layer")


class LayerSpec:
    """A layer described, not built: typename(*args, **kwargs) runs only on the stage that owns it."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log=False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self):
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A LayerSpec whose module is shared by every position with the same `key` (e.g. the token
    embedding reused as the output head: forward_fn=lambda emb, x: x @ emb.weight.T)."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def layer_name(layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def trainable_params(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad) if isinstance(module, nn.Module) else 0


class Tied(nn.Module):
    """A position in the layer list that calls a shared (tied) module, maybe through forward_fn."""

    def __init__(self, key, module, forward_fn):
        super().__init__()
        self.key, self.forward_fn = key, forward_fn
        object.__setattr__(self, "shared", module)      # not a submodule: owned once, by the chunk's `tied`

    def forward(self, x):
        return self.forward_fn(self.shared, x) if self.forward_fn is not None else self.shared(x)


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _has_params(m) -> bool:
    mod = m.shared if isinstance(m, Tied) else m
    return any(True for _ in mod.parameters())


class StageChunk(nn.Module):
    """The layers start … stop-1 of one (virtual) stage, keyed by their global index like
    DeepSpeed's stage modules ("3.weight" is layer 3's weight), plus the tied modules it uses."""

    def __init__(self, layers: dict, tied: dict, start: int, stop: int, checkpoint_interval: int,
                 checkpoint_func=None, checkpointable_layers=None):
        super().__init__()
        self.start, self.stop, self.interval = start, stop, checkpoint_interval
        self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})
        self.tied = nn.ModuleDict(tied)
        self.checkpoint_func, self.checkpointable = checkpoint_func, checkpointable_layers

    def _run(self, lo: int, hi: int, x):
        for i in range(lo, hi):
            x = self.layers[str(i)](x)
        return x

    def _checkpointed(self, lo: int, hi: int) -> bool:
        mods = [self.layers[str(i)] for i in range(lo, hi)]
        if self.checkpointable is not None:
            return all(type(m.shared if isinstance(m, Tied) else m).__name__ in self.checkpointable for m in mods)
        return any(_has_params(m) for m in mods)

    def forward(self, x):
        if self.interval <= 0:
            return self._run(self.start, self.stop, x)
        for lo in range(self.start, self.stop, self.interval):
            hi = min(lo + self.interval, self.stop)
            if not self._checkpointed(lo, hi):
                x = self._run(lo, hi, x)
            elif self.checkpoint_func is not None:         # the caller's function, called as DeepSpeed calls it
                x = self.checkpoint_func(lambda t, lo=lo, hi=hi: self._run(lo, hi, t), x)
            else:   # keep only this group's input; backward recomputes the group (one extra forward)
                x = checkpoint(self._run, lo, hi, x, use_reentrant=False)
        return x


class TiedWeights:
    def __init__(self, engine):
        self.e = engine
        owners = engine.module.tied_owners(engine.pp, engine.v)
        attrs = {}
        for spec in engine.module.layers:
            if isinstance(spec, TiedLayerSpec):
                attrs.setdefault(spec.key, spec.tied_weight_attr)
        local = {k: m for ch in engine.chunks for k, m in ch.tied.items()}
        # (key, holders, [this rank's parameters of the tied attributes, dotted names too])
        self.groups = [(key, owners[key], [attrgetter(a)(local[str(key)]) for a in attrs[key]])
                       for key in sorted(owners, key=str) if len(owners[key]) > 1 and engine.stage in owners[key]]
        self._replicas = {id(p) for key, holders, params in self.groups if engine.stage != holders[0]
                          for p in local[str(key)].parameters()}

    def is_replica(self, p) -> bool:
        return id(p) in self._replicas

    def _exchange(self, holders, mine):
        """Every holder's tensor: ours sent to each other holder and theirs received, posted as one
        group (the textbook Communicator.exchange), so no per-peer order can deadlock under nccl."""
        others = [h for h in holders if h != self.e.stage]
        got = {h: torch.empty_like(mine) for h in others}
        for req in self.e.comm.exchange(sends=[(mine, h) for h in others], recvs=[(got[h], h) for h in others]):
            req.wait()
        return {self.e.stage: mine, **got}

    def broadcast_initial(self):
        e = self.e
        for key, holders, params in self.groups:
            for p in params:
                if e.stage == holders[0]:
                    reqs = [e.comm.isend(p.data.contiguous(), h) for h in holders[1:]]
                    for r in reqs:
                        r.wait()
                else:
                    buf = torch.empty_like(p.data)
                    e.comm.irecv(buf, holders[0]).wait()
                    p.data.copy_(buf)

    def reduce_grads(self):
        for key, holders, params in self.groups:
            for p in params:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                got = self._exchange(holders, g.contiguous())
                total = got[holders[0]].clone()
                for h in holders[1:]:
                    total += got[h]
                p.grad = total
