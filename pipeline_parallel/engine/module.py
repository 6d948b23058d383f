"""PipelineModule: a model written as a list of layers, cut into pipeline stages.

    model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 8), nn.GELU(), ...], num_stages=2,
                           loss_fn=nn.functional.cross_entropy, partition_method="parameters")
    engine, *_ = pipeline_parallel.initialize(model=model, config="ds_config.json")

deepspeed.pipe.PipelineModule's constructor: layers are nn.Modules, LayerSpec / TiedLayerSpec
(built lazily, only on the stage that owns them, seeded base_seed + index with seed_layers) or
parameter-free callables; partition_method "uniform", "parameters", "type:<regex>", or (our
extensions) a list of per-stage layer counts (gdGPT's `parts`) or of num_stages + 1 boundaries;
topology instead of num_stages; activation_checkpoint_interval k: groups of k layers under
torch.utils.checkpoint; loss_fn(outputs, labels) on the last stage; dynamic_shape: shapes sent every micro-batch.
The module is an nn.Module: parameters() / state_dict() / forward hold this rank's stage (by the
topology), built on first use — the modules initialize() then trains.
With v virtual stages (interleaved) the layers are cut into num_stages·v chunks and rank s holds
chunks s, s + p, … (Megatron-LM's assignment). Tied layers share one module per rank; between
ranks the engine sums their gradients (TiedWeights, engine/layers.py). Cost: building is local;
"parameters" builds each LayerSpec once, one at a time, on every rank, as DeepSpeed does.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn as nn

import pipeline_parallel.partition as part
from pipeline_parallel.engine.layers import (Fn, LayerSpec, PartitionError, StageChunk, Tied, TiedLayerSpec,
                                             check_partition, layer_name, trainable_params)
from pipeline_parallel.engine.topology import PipeDataParallelTopology, ProcessTopology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PartitionError", "check_partition", "layer_name"]


class PipelineModule(nn.Module):
    """The layer list, its partition into stages, and this rank's stage (an nn.Module: parameters(),
    state_dict(), forward over the stage's layers, as DeepSpeed's)."""

    def __init__(self, layers, num_stages: int | None = None, topology: ProcessTopology | None = None, loss_fn=None,
                 seed_layers: bool = False, seed_fn=None, base_seed: int = 1234, partition_method="parameters",
                 activation_checkpoint_interval: int = 0, activation_checkpoint_func=None,
                 checkpointable_layers=None, dynamic_shape: bool = False):
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        if topology is not None:
            if num_stages is not None and num_stages != topology.get_dim("pipe"):
                raise PartitionError(f"num_stages={num_stages} but the topology has {topology.get_dim('pipe')} pipe ranks")
            num_stages = topology.get_dim("pipe")
        self.dynamic_shape = dynamic_shape     # each boundary's shape sent every micro-batch (engine/draining.py)
        self.layers = list(layers)
        if not isinstance(num_stages, int) or num_stages < 1:
            raise PartitionError(f"num_stages must be a positive int, got {num_stages!r}")
        if len(self.layers) < num_stages:
            raise PartitionError(f"num_stages={num_stages} is more stages than layers ({len(self.layers)}); "
                                 "every stage needs at least one layer")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be an int >= 0, got {activation_checkpoint_interval!r}")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("param `checkpointable_layers` must be type of list.")
        for i, layer in enumerate(self.layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"layer {i} is {type(layer).__name__}: expected an nn.Module, a LayerSpec or a callable")
        self.num_stages, self.loss_fn, self._topo = num_stages, loss_fn, topology
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func, self.checkpointable_layers = activation_checkpoint_func, checkpointable_layers
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self._counts, self._built, self._chunks, self._registered = None, None, [], []
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
            vals = [int(b) for b in method]
            if len(vals) == num_parts + 1:                 # boundaries 0 = p0 <= … <= n
                parts = vals
            elif len(vals) == num_parts and sum(vals) == n:   # per-stage layer counts (gdGPT's `parts`)
                parts = [0]
                for c in vals:
                    parts.append(parts[-1] + c)
            else:
                raise PartitionError(f"explicit partition {vals} for {num_parts} stages: expected {num_parts} per-stage "
                                     f"layer counts summing to {n} (the number of layers) or {num_parts + 1} "
                                     f"boundaries 0 … {n}")
        elif not isinstance(method, str):
            raise ValueError(f"partition_method must be a string or a list, got {method!r}")
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
            raise ValueError(f"partition_method {method!r} is not one of 'uniform', 'parameters', 'type:<regex>', "
                             "a list of per-stage layer counts or a boundary list")
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
                (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
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
                    built[i] = Tied(spec.key, tied_here[spec.key], spec.forward_fn)
                else:
                    m = self._build(i, spec)
                    built[i] = m if isinstance(m, nn.Module) else Fn(m)
            chunks.append(StageChunk(built, used, parts[g], parts[g + 1], self.activation_checkpoint_interval,
                                     self.activation_checkpoint_func, self.checkpointable_layers))
        return chunks

    def stage_chunks(self, stage: int, num_stages: int, virtual_stages: int = 1) -> list[StageChunk]:
        """build_chunks once per (stage, p, v), the modules registered on this nn.Module under
        DeepSpeed's names ("3.weight", "tied_modules.<key>.weight"): parameters() taken before
        initialize() are the ones the engine trains."""
        key = (stage, num_stages, virtual_stages)
        if self._built != key:
            for name in self._registered:
                del self._modules[name]
            self._chunks = self.build_chunks(stage, num_stages, virtual_stages)
            tied = nn.ModuleDict()
            for ch in self._chunks:
                tied.update(ch.tied)
            self.tied_modules = tied                    # first, as DeepSpeed registers it: parameters() order
            for ch in self._chunks:
                for i, m in ch.layers.items():
                    if not isinstance(m, (Tied, Fn)):
                        self.add_module(i, m)
            self._registered = [n for n in self._modules if n.isdigit()] + ["tied_modules"]
            self._built = key
        return self._chunks

    def default_stage(self) -> int:
        """This rank's stage by the topology (DeepSpeed's PipeDataParallelTopology by default)."""
        if not dist.is_initialized():
            if self.num_stages == 1:
                return 0
            raise RuntimeError(f"PipelineModule with num_stages={self.num_stages}: torch.distributed is not initialised, "
                               "so this rank's stage is unknown (DeepSpeed's PipelineModule needs it at construction "
                               "too); call deepspeed.init_distributed() / torch.distributed.init_process_group first")
        rank, world = dist.get_rank(), dist.get_world_size()
        if self._topo is None and world % self.num_stages:
            raise RuntimeError(f"rank {rank}: num_stages ({self.num_stages}) must divide distributed world size ({world})")
        return self.topology().get_coord(rank).pipe

    def _ensure_built(self):
        if self._built is None:
            self.stage_chunks(self.default_stage(), self.num_stages)

    def named_parameters(self, *args, **kwargs):
        self._ensure_built()
        return super().named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        self._ensure_built()
        return super().named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        self._ensure_built()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self._ensure_built()
        return super().load_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self._ensure_built()
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x):
        """This rank's layers in order (one process with num_stages = 1: the whole model)."""
        self._ensure_built()
        if len(self._chunks) != 1:
            raise RuntimeError(f"PipelineModule.forward runs one contiguous stage; this rank holds {len(self._chunks)} "
                               "interleaved chunks (use the engine's train_batch / eval_batch)")
        return self._chunks[0](x)

    def set_checkpoint_interval(self, interval: int) -> None:
        """DeepSpeed's setter: the interval the next forward uses, built stages included."""
        assert interval >= 0
        self.activation_checkpoint_interval = interval
        for chunk in self._chunks:
            chunk.interval = interval
        if self._chunks or hasattr(self, "is_checkpointable_results"):     # the cache, rebuilt for the new interval
            self._precompute_checkpointable_values()

    def set_checkpoint_func(self, func) -> None:
        """The function checkpointed groups run under (None: torch's non-reentrant), built stages too."""
        self.activation_checkpoint_func = func
        for chunk in self._chunks:
            chunk.checkpoint_func = func

    def _precompute_checkpointable_values(self) -> None:
        """DeepSpeed's is_checkpointable_results: per block of `interval` layers of this rank's stage
        (stage 0, built for this, before the stage is), whether forward checkpoints it (StageChunk._checkpointed)."""
        k = self.activation_checkpoint_interval
        chunk = self._chunks[0] if self._chunks else self.build_chunks(0, self.num_stages)[0]
        if k > 0:
            self.is_checkpointable_results = [chunk._checkpointed(lo, min(lo + k, chunk.stop))
                                              for lo in range(chunk.start, chunk.stop, k)]

    def topology(self):
        return self._topo if self._topo is not None else PipeDataParallelTopology(
            self.num_stages, (dist.get_world_size() if dist.is_initialized() else 1) // self.num_stages)

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def tied_owners(self, num_stages: int, virtual_stages: int = 1) -> dict:
        """key -> sorted pipeline ranks that hold a copy of that tied module."""
        parts = self.partition(num_stages * virtual_stages)
        owners: dict = {}
        for g in range(num_stages * virtual_stages):
            for i in range(parts[g], parts[g + 1]):
                if isinstance(self.layers[i], TiedLayerSpec):
                    owners.setdefault(self.layers[i].key, set()).add(g % num_stages)
        return {k: sorted(v) for k, v in owners.items()}
