"""Activation checkpointing: DeepSpeed's `activation_checkpointing` section and HF's
gradient_checkpointing_enable(), under every ZeRO stage.

    "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false}
    python -m benchmarks.activation_checkpointing          (activation memory saved, measured)

The trade: a checkpointed block keeps only its inputs from the forward and runs its forward a
second time in backward to rebuild what the gradient needs. Memory: activations fall from
~(layers × per-layer activations) to (layers × block inputs) + one layer's activations; compute:
one extra forward, ~+33% of a step's FLOPs (forward ≈ 1/3 of forward+backward).

What the engine does with the section (DeepSpeed itself only configures its `checkpoint()` and
leaves the model alone; we also switch the model over, so the key does what it says):
  a Hugging Face model that supports it   model.gradient_checkpointing_enable() (non-reentrant)
  a Hugging Face model that does not       ActivationCheckpointingError naming the class
  any other nn.Module                      a start-up warning: call `checkpoint(fn, *args)` below
                                           in forward (DeepSpeed's deepspeed.checkpointing.checkpoint)
  cpu_checkpointing                        keeps the saved block inputs on the host (HF's offload):
                                           on a CPU-only run they are there already (said at start-up)
  partition_activations, contiguous_memory_optimization, number_checkpoints,
  synchronize_checkpoint_boundary, profile  accepted with a warning: they split activations across
                                           model-parallel ranks or tune CUDA memory; neither exists here
ZeRO-3: the recompute runs each module's forward again, so its forward pre-hook all-gathers the
module's parameters again (and the post-hook frees them): one more (N-1)/N·b·Ψ per micro-batch
for the checkpointed part, on top of stage 3's 3(N-1)/N·b·Ψ. Stages 0-2 hold full parameters and
pay nothing extra in communication.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
        "synchronize_checkpoint_boundary", "profile"}
NO_OPS = ("partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile")


class ActivationCheckpointingError(ValueError):
    """The model cannot be checkpointed as the config asks."""


def parse(raw: dict) -> dict | None:
    """The `activation_checkpointing` section, validated (None when absent)."""
    s = raw.get("activation_checkpointing")
    if s is None:
        return None
    if not isinstance(s, dict):
        raise ValueError(f"config key 'activation_checkpointing' = {s!r} is invalid; allowed: a dict with keys {sorted(KEYS)}")
    bad = set(s) - KEYS
    if bad:
        raise ValueError(f"config keys {sorted('activation_checkpointing.' + k for k in bad)} are not supported; "
                         f"allowed: {sorted(KEYS)}")
    return dict(s)


def checkpoint(function, *args, **kwargs):
    """Torch's non-reentrant checkpoint (DeepSpeed's non_reentrant_checkpoint; ringzero's own default)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


_WARNED: set = set()


def reentrant_checkpoint(function, *args):
    """DeepSpeed's default deepspeed.checkpointing.checkpoint: torch's reentrant checkpoint, whose
    gradients reach the block's parameters only through an input that requires grad. With none (a
    first block fed token ids) DeepSpeed's would leave those parameters without gradients (it avoids
    that only for classes named GPTModelPipe); here that block runs non-reentrant, warned once."""
    if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad for a in args):
        if "no input" not in _WARNED:
            _WARNED.add("no input")
            warnings.warn("zero_from_scratch: reentrant activation checkpointing of a block none of whose inputs "
                          "requires grad would leave its parameters without gradients; that block runs "
                          "non-reentrant (pipeline.use_reentrant: false does so everywhere)", stacklevel=2)
        return checkpoint(function, *args)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)


def apply(model: nn.Module, section: dict | None, rank: int = 0) -> str:
    """Switch `model` to activation checkpointing as the section asks; returns what was done."""
    if section is None:
        return "off"
    for k in NO_OPS + ("number_checkpoints",):
        if section.get(k):
            warnings.warn(f"zero_from_scratch: activation_checkpointing.{k}={section[k]!r} has no effect here "
                          "(no model-parallel ranks to partition across, no CUDA memory to tune)", stacklevel=3)
    offload = bool(section.get("cpu_checkpointing"))
    on_cuda = any(p.is_cuda for p in model.parameters())
    if offload and not on_cuda:
        warnings.warn("zero_from_scratch: activation_checkpointing.cpu_checkpointing: the model is on the CPU, "
                      "so the checkpoints are in host memory already", stacklevel=3)
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        warnings.warn(f"zero_from_scratch: 'activation_checkpointing' is set but {type(model).__name__} is not a "
                      "Hugging Face model: wrap blocks in zero_from_scratch.engine.activation_checkpointing.checkpoint(fn, "
                      "*args) in its forward, or nothing is checkpointed", stacklevel=3)
        return "manual"
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ActivationCheckpointingError(
            f"rank {rank}: 'activation_checkpointing' is set but {type(model).__name__} does not support activation "
            "checkpointing (transformers: supports_gradient_checkpointing=False); remove the section or use a "
            "model that supports it")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)    # transformers 5 renames the method
        kw = {"offload": True} if offload and on_cuda else {}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **kw)
    if hasattr(model, "config") and hasattr(model.config, "use_cache"):
        model.config.use_cache = False                    # a KV cache and recompute do not mix
    return "hf" + ("+cpu" if kw else "")
