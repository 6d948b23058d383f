"""ZeRO-1/2/3 from scratch: a textbook (this folder's top level) and the DeepSpeed-API engine on it.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 3
    python -m pytest tests/test_zero_units.py -k textbook

Textbook, in reading order (imports only torch and each other; collectives go through a `comm`
object's methods): sharding.py (the one layout function), stage1.py (ZeRO-1, ZeRO-0),
stage2.py (ZeRO-2), stage3.py (ZeRO-3), optim.py (Adam on a shard), clip.py (the global
gradient norm over shards, and clipping).
Engine (engine/, built on the textbook): `initialize` and ZeroEngine (zero_engine.py) driven by
DeepSpeed's JSON config (config.py, auto.py, mpu.py), precision and loss scaling, the stages with
overlap and bucket pools (stages.py, stage3.py, prefetch.py, hpz.py, saved.py, divergence.py),
frozen and external parameters, offload, checkpoints, monitors, ledgers, DeepSpeed's LR
schedules, comm.py (primitives or torch.distributed). Parity with DeepSpeed: parity/.
"""
import importlib

# The engine's public names resolve on first use (PEP 562), so importing a textbook module loads no engine module.
_LAZY = {"initialize": "zero_engine", "ZeroEngine": "zero_engine", "load_config": "config",
         "consolidate": "checkpoint_read", "CheckpointError": "checkpoint_read", "ZeroDivergenceError": "divergence",
         "register_external_parameter": "external", "ZeroExternalParameterError": "external"}

_MODULES = {"zero": "zero_init"}   # zero_from_scratch.zero.Init / .GatheredParameters, as deepspeed.zero

__all__ = list(_LAZY) + list(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"zero_from_scratch.engine.{_MODULES[name]}")
    if name not in _LAZY:
        raise AttributeError(f"module 'zero_from_scratch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zero_from_scratch.engine.{_LAZY[name]}"), name)
