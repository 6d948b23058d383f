"""The model's cast for bf16/fp16 training, DeepSpeed 0.19.8's way: parameters cast, buffers as loaded.

    python -m pytest tests/test_mixed_cast.py        (1 process, against the installed DeepSpeed's functions)

Each floating parameter (fp16/bf16/fp32/fp64) becomes the training dtype; a buffer keeps the dtype it
was loaded in (an fp32 rotary inv_freq stays fp32, beside bf16 weights: the model decides where to
cast, as under DeepSpeed) unless data_types.buffer_dtype names one. data_types.keep_in_fp32_modules
names buffers kept in (or brought back to) fp32 even then: "auto" (default) the model's transformers
lists (_keep_in_fp32_modules_strict; _keep_in_fp32_modules too under fp16), a list of name patterns
(`*` any characters, matched anywhere in the buffer's full name), [] none. data_types.param_dtype,
if set, must be the training dtype (DeepSpeed asserts). In fp32 nothing is cast (DeepSpeed ignores
buffer_dtype there too). Sources: runtime/engine.py (_configure_distributed_model and the three
methods served below), runtime/keep_in_fp32.py. Cost: one pass over parameters and buffers at initialize.
"""
from __future__ import annotations

import re
import warnings

import torch

NAMES = {torch.float16: ("torch.float16", "fp16", "float16", "half"),
         torch.float32: ("torch.float32", "fp32", "float32", "float"),
         torch.int8: ("torch.int8", "int8"), torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16")}
CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_of(name) -> torch.dtype:
    """DeepSpeed's DtypeEnum(name).value."""
    for dt, names in NAMES.items():
        if name == dt or name in names:
            return dt
    raise ValueError(f"{name!r} is not a valid DtypeEnum")


class DataTypes:
    """The data_types section's fields as DeepSpeedConfig holds them (raw strings or None, "auto")."""

    def __init__(self, raw: dict):
        d = raw.get("data_types") or {}
        self.param_dtype, self.buffer_dtype = d.get("param_dtype"), d.get("buffer_dtype")
        self.keep_in_fp32_modules = d.get("keep_in_fp32_modules", "auto")
        k = self.keep_in_fp32_modules
        if k != "auto" and not (isinstance(k, list) and all(isinstance(n, str) for n in k)):
            raise ValueError(f"data_types.keep_in_fp32_modules must be \"auto\" or a list of name patterns, got {k!r}")


class MixedPrecisionCast:
    """Mixed into the engines: DeepSpeedEngine's three methods, reading self._config as DeepSpeed does."""

    @property
    def _config(self):            # DeepSpeed's name for the parsed config (ZeroRunConfig: data_types' fields too)
        return self.config

    def _assert_valid_mixed_precision_config(self):
        if self._config.param_dtype is None:
            return
        model_dtype = torch.half if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        requested = dtype_of(self._config.param_dtype)
        assert requested == model_dtype, (f"data_types.param_dtype='{self._config.param_dtype}' conflicts with the "
                                          f"enabled precision mode (model dtype {model_dtype}). Set the matching "
                                          f"fp16/bf16 'enabled' flag or omit data_types.param_dtype.")

    def _mixed_precision_dtypes(self):
        param_dtype = torch.half if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else None
        buffer_dtype = None if self._config.buffer_dtype is None else dtype_of(self._config.buffer_dtype)
        return param_dtype, buffer_dtype

    def _cast_module_mixed_precision(self, param_dtype, buffer_dtype, is_zero_init_model, keep_pattern=None):
        if param_dtype is not None and not is_zero_init_model:
            for p in self.module.parameters(recurse=True):
                if p.dtype in CASTABLE and p.dtype != param_dtype:
                    p.data = p.data.to(param_dtype)
        kept = set()
        if keep_pattern is not None:
            kept = {id(b) for b in buffers_to_keep_in_fp32(self.module, keep_pattern)}
            for b in buffers_to_keep_in_fp32(self.module, keep_pattern):   # also upcasts a low-precision one
                if b.dtype != torch.float32:
                    b.data = b.data.float()
        if buffer_dtype is not None:
            for b in self.module.buffers(recurse=True):
                if id(b) not in kept and b.dtype in CASTABLE and b.dtype != buffer_dtype:
                    b.data = b.data.to(buffer_dtype)

    def cast_for_training(self) -> None:
        """_configure_distributed_model's cast. ringzero's zero.Init shards keep the dtype they were built in,
        so parameters are cast at every stage (a no-op where zero.Init already used the training dtype)."""
        self._assert_valid_mixed_precision_config()
        if self.fp16_enabled() or self.bfloat16_enabled():
            param_dtype, buffer_dtype = self._mixed_precision_dtypes()
            keep = keep_in_fp32_pattern(self.module, self._config.keep_in_fp32_modules, param_dtype)
            self._cast_module_mixed_precision(param_dtype, buffer_dtype, False, keep)
        elif self._config.buffer_dtype is not None or self._config.keep_in_fp32_modules not in ("auto", None, []):
            warnings.warn("data_types.buffer_dtype / keep_in_fp32_modules: ignored in fp32 training, as DeepSpeed "
                          "casts nothing without fp16/bf16 (runtime/engine.py::_configure_distributed_model)",
                          stacklevel=3)


def keep_in_fp32_pattern(module, setting, dtype):
    """The compiled pattern of buffer names kept in fp32, or None (keep_in_fp32.py's rule)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting is None or setting == "auto":
        patterns = set()
        for module_name, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(module_name)}\..*{pattern}" if module_name else pattern)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def buffers_to_keep_in_fp32(module, pattern):
    out = []
    for module_name, owner in module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        out += [b for n, b in owner.named_buffers(recurse=False)
                if b is not None and b.is_floating_point() and pattern.search(prefix + n)]
    return out


def cast_model(module, raw: dict, dtype: torch.dtype) -> None:
    """cast_for_training for an engine without the mixin (the pipeline's): `raw` its config, `dtype` its training dtype."""
    e = type("PipelineCast", (MixedPrecisionCast,), {"_config": DataTypes(raw or {})})()
    e.module = module
    e.fp16_enabled, e.bfloat16_enabled = (lambda: dtype == torch.float16), (lambda: dtype == torch.bfloat16)
    e.cast_for_training()
