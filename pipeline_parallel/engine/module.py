"""PipelineModule: a model written as a list of layers, cut into pipeline stages.

    model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 8), nn.GELU(), ...], num_stages=2,
                           loss_fn=nn.functional.cross_entropy, partition_method="parameters")
    engine, *_ = pipeline_parallel.initialize(model=model, config="ds_config.json")

Constructor semantics of deepspeed.pipe.PipelineModule:
  layers             nn.Module instances, or LayerSpec / TiedLayerSpec (built lazily: a rank builds
                     only the layers of its own stage, so a model too big for one device never
                     exists whole), or plain callables without parameters (e.g. a lambda).
  partition_method   "uniform" (equal layer counts), "parameters" (balance trainable parameters),
                     "type:<regex>" (balance layers whose class name matches, case-insensitive),
                     or an explicit boundary list [0, …, len(layers)] (our extension).
  activation_checkpoint_interval   k > 0: each stage runs its layers in groups of k under
                     torch.utils.checkpoint (only the group inputs are kept; backward recomputes).
  loss_fn            loss = loss_fn(outputs, labels) on the last stage.
  seed_layers        torch.manual_seed(base_seed + layer index) before building each LayerSpec,
                     so the weights do not depend on which rank builds them.

With v virtual stages (interleaved schedule) the layers are cut into num_stages·v chunks and
rank s holds chunks s, s + p, s + 2p, … (Megatron-LM's assignment). Tied layers (TiedLayerSpec
with the same key) share one module per rank; between ranks the engine keeps them equal by
summing their gradients (pipeline_parallel/engine/tied.py). Cost: building is local; counting the
parameters for "parameters" builds each LayerSpec once, one at a time, on every rank, as
DeepSpeed does.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import pipeline_parallel.partition as part


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

    def build(self) -> nn.Module:
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


class _Tied(nn.Module):
    """A position in the layer list that calls a shared (tied) module, maybe through forward_fn."""

    def __init__(self, key, module, forward_fn):
        super().__init__()
        self.key, self.forward_fn = key, forward_fn
        object.__setattr__(self, "shared", module)      # not a submodule: owned once, by the chunk's `tied`

    def forward(self, x):
        return self.forward_fn(self.shared, x) if self.forward_fn is not None else self.shared(x)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class StageChunk(nn.Module):
    """The layers start … stop-1 of one (virtual) stage, keyed by their global index like
    DeepSpeed's stage modules ("3.weight" is layer 3's weight), plus the tied modules it uses."""

    def __init__(self, layers: dict, tied: dict, start: int, stop: int, checkpoint_interval: int):
        super().__init__()
        self.start, self.stop, self.interval = start, stop, checkpoint_interval
        self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})
        self.tied = nn.ModuleDict(tied)

    def _run(self, lo: int, hi: int, x):
        for i in range(lo, hi):
            x = self.layers[str(i)](x)
        return x

    def forward(self, x):
        if self.interval <= 0:
            return self._run(self.start, self.stop, x)
        for lo in range(self.start, self.stop, self.interval):
            hi = min(lo + self.interval, self.stop)
            # keep only this group's input; backward recomputes the group (one extra forward)
            x = checkpoint(self._run, lo, hi, x, use_reentrant=False)
        return x


class PipelineModule:
    """The layer list, its partition into stages, and the builder of one rank's stage chunks."""

    def __init__(self, layers, num_stages: int, loss_fn=None, partition_method="parameters",
                 activation_checkpoint_interval: int = 0, seed_layers: bool = False, base_seed: int = 1234):
        self.layers = list(layers)
        if not isinstance(num_stages, int) or num_stages < 1:
            raise PartitionError(f"num_stages must be a positive int, got {num_stages!r}")
        if len(self.layers) < num_stages:
            raise PartitionError(f"num_stages={num_stages} is more stages than layers ({len(self.layers)}); "
                                      "every stage needs at least one layer")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be an int >= 0, got {activation_checkpoint_interval!r}")
        for i, layer in enumerate(self.layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"layer {i} is {type(layer).__name__}: expected an nn.Module, a LayerSpec or a callable")
        self.num_stages, self.loss_fn = num_stages, loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.seed_layers, self.base_seed = seed_layers, base_seed
        self._counts = None
        self.parts = self.partition(num_stages)

    # ------------------------------------------------------------------ partitioning
    def param_counts(self) -> list[int]:
        """Trainable parameters per layer (each LayerSpec built once, then dropped)."""
        if self._counts is None:
            self._counts = [trainable_params(self._build(i, layer)) if isinstance(layer, LayerSpec)
                            else trainable_params(layer) for i, layer in enumerate(self.layers)]
        return self._counts

    def partition(self, num_parts: int) -> list[int]:
        n, method = len(self.layers), self.partition_method
        if isinstance(method, (list, tuple)):
            parts = [int(b) for b in method]
            if len(parts) != num_parts + 1:
                raise PartitionError(f"explicit partition {parts} has {len(parts) - 1} stages, expected {num_parts}")
        elif not isinstance(method, str):
            raise ValueError(f"partition_method must be a string or a boundary list, got {method!r}")
        elif method.lower() == "uniform":
            parts = part.uniform(n, num_parts)
        elif method.lower() == "parameters":
            parts = part.balanced(self.param_counts(), num_parts)
        elif method.lower().startswith("type:"):
            rx = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            weights = [1 if rx.search(layer_name(layer)) else 0 for layer in self.layers]
            if not any(weights):
                raise PartitionError(f"partition_method {method!r} matches no layer; layer types: "
                                          f"{sorted({layer_name(layer) for layer in self.layers})}")
            parts = part.balanced(weights, num_parts)
        else:
            raise ValueError(f"partition_method {method!r} is not one of 'uniform', 'parameters', 'type:<regex>' "
                             "or a boundary list")
        check_partition(parts, n)
        return parts

    def split_table(self, num_parts: int | None = None) -> list[dict]:
        """Per stage: its layers and trainable parameters (tied modules counted where they sit)."""
        parts = self.partition(num_parts or self.num_stages)
        counts = self.param_counts()
        return [{"stage": s, "layers": f"{parts[s]}–{parts[s + 1] - 1}",
                 "types": ", ".join(layer_name(self.layers[i]) for i in range(parts[s], parts[s + 1])),
                 "params": sum(counts[parts[s]:parts[s + 1]])} for s in range(len(parts) - 1)]

    # ------------------------------------------------------------------ building one rank's chunks
    def _build(self, idx: int, spec):
        if isinstance(spec, LayerSpec):
            if self.seed_layers:
                torch.manual_seed(self.base_seed + idx)
            return spec.build()
        return spec

    def build_chunks(self, stage: int, num_stages: int, virtual_stages: int = 1) -> list[StageChunk]:
        """The chunks rank `stage` runs: virtual stages stage, stage + p, … (one chunk when v = 1)."""
        parts = self.partition(num_stages * virtual_stages)
        tied_here: dict = {}
        chunks = []
        for c in range(virtual_stages):
            g = c * num_stages + stage
            built, used = {}, {}
            for i in range(parts[g], parts[g + 1]):
                spec = self.layers[i]
                if isinstance(spec, TiedLayerSpec):
                    if spec.key not in tied_here:
                        tied_here[spec.key] = self._build(i, spec)
                    used[str(spec.key)] = tied_here[spec.key]
                    built[i] = _Tied(spec.key, tied_here[spec.key], spec.forward_fn)
                else:
                    m = self._build(i, spec)
                    built[i] = m if isinstance(m, nn.Module) else _Fn(m)
            chunks.append(StageChunk(built, used, parts[g], parts[g + 1], self.activation_checkpoint_interval))
        return chunks

    def tied_owners(self, num_stages: int, virtual_stages: int = 1) -> dict:
        """key -> sorted pipeline ranks that hold a copy of that tied module."""
        parts = self.partition(num_stages * virtual_stages)
        owners: dict = {}
        for g in range(num_stages * virtual_stages):
            for i in range(parts[g], parts[g + 1]):
                if isinstance(self.layers[i], TiedLayerSpec):
                    owners.setdefault(self.layers[i].key, set()).add(g % num_stages)
        return {k: sorted(v) for k, v in owners.items()}
