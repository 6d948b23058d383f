"""DeepSpeed's config objects, for scripts that parse a config as DeepSpeed does before `initialize`.

    python -c "from zero_from_scratch.as_deepspeed.config_objects import DeepSpeedConfig as C; print(C({'train_batch_size': 8}).train_micro_batch_size_per_gpu)"

Served as `deepspeed.runtime.config.DeepSpeedConfig`, `deepspeed.runtime.zero.config.DeepSpeedZeroConfig`
(+ its offload sections) and `deepspeed.runtime.precision_config.get_bfloat16_config`. The sections are
DeepSpeed 0.19.8's schemas (runtime/zero/config.py, offload_config.py, leaf_module_config.py,
precision_config.py: field names, defaults, aliases, deprecations, bounds) declared on ringzero's
DeepSpeedConfigModel (config_model.py), so a typo is a ValidationError as there. DeepSpeedConfig reads
the file as DeepSpeed does (hjson, duplicate keys refused), takes DeepSpeed's data-parallel world size
(an mpu's, mesh_device's "data_parallel" group, or the world ÷ the config's sequence_parallel_size:
data_parallel_size), applies DeepSpeed's gradient_allreduce_op checks, and resolves the batch sizes with ringzero's own parser (engine/config.py load_config), whose
object it keeps as `.ringzero`. Cost: one pydantic validation per object.
"""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch.distributed as dist
from pydantic import Field, model_validator

from zero_from_scratch.as_deepspeed.config_model import DeepSpeedConfigModel
from zero_from_scratch.as_deepspeed.constants import OffloadDeviceEnum
from zero_from_scratch.as_deepspeed.utils import logger
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.leaf import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAMES,
                                           DEFAULT_LEAF_MODULE_NAME_SUFFIXES)


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    device: OffloadDeviceEnum = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    device: OffloadDeviceEnum = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def set_pipeline(self):           # DeepSpeed's derived attribute, not a field
        self.__dict__["pipeline"] = self.pipeline_read or self.pipeline_write
        return self


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    classes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @model_validator(mode="before")
    def _one_string_is_a_list(cls, values):
        if values is None:
            return {}
        if not isinstance(values, dict):
            raise TypeError("leaf_module configuration must be a mapping of fields to values")
        return {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                for k, v in values.items()}

    @model_validator(mode="after")
    def _dedupe(self):
        for k in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, k, list(dict.fromkeys(str(x) for x in getattr(self, k))))
        return self


def _deprecated(new: str, fn=None, set_new: bool = True):
    extra = {"deprecated": True, "new_param": new, "set_new_param": set_new}
    return Field(None, json_schema_extra={**extra, **({"new_param_fn": fn} if fn else {})})


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: Optional[bool] = None          # None: True at stage 3, else False (DeepSpeed's validator)
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None
    zenflow: Optional[dict] = None                # ZenFlow's own section: ringzero's engine refuses it
    sub_group_size: int = Field(1_000_000_000, ge=0)
    cpu_offload_param: Optional[bool] = _deprecated(
        "offload_param", lambda v: DeepSpeedZeroOffloadParamConfig(device=OffloadDeviceEnum.cpu) if v else None)
    cpu_offload_use_pin_memory: Optional[bool] = _deprecated("offload_param or offload_optimizer", set_new=False)
    cpu_offload: Optional[bool] = _deprecated(
        "offload_optimizer", lambda v: DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu) if v else None)
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = Field(False, json_schema_extra={
        "deprecated": True, "new_param": "gather_16bit_weights_on_model_save"})
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)

    @model_validator(mode="after")
    def _defaults_and_checks(self):
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError("compute_grad_norm=false is supported only with ZeRO Stage 1 or 2")
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0:
            assert self.stage == 3, "Partial offloading only supported for ZeRO Stage 3."
        if self.stage == 3 and self.elastic_checkpoint:
            logger.warning("ZeRO-3 elastic checkpointing is deprecated and no longer supported. "
                           "Use Universal Checkpointing instead.")
        return self


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """The "bf16" section, else DeepSpeed's older "bfloat16" one."""
    section = param_dict.get("bf16")
    return DeepSpeedBF16Config(**(section if section is not None else param_dict.get("bfloat16", {})))


def get_zero_config(param_dict: dict) -> DeepSpeedZeroConfig:
    z = param_dict.get("zero_optimization", {})
    if isinstance(z, bool):           # DeepSpeed's deprecated form: true = stage 1
        z = {"stage": int(z)} | ({"allgather_bucket_size": param_dict.get("allgather_size", 500_000_000)} if z else {})
    return DeepSpeedZeroConfig(**z)


def _no_duplicates(pairs):
    keys = [k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1]
    if keys:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {keys}")
    return dict(pairs)


def read_config(config) -> dict:
    """A dict as given; a path read as DeepSpeed reads it (hjson, duplicate keys a ValueError)."""
    if isinstance(config, dict):
        return config
    if not os.path.exists(config):
        raise ValueError(f"Expected a string path to an existing deepspeed config, or a dictionary. Received: {config}")
    with open(config) as f:
        try:
            import hjson    # DeepSpeed's dependency (it reads configs with it: trailing commas, comments)
        except ImportError:
            return json.load(f, object_pairs_hook=_no_duplicates)
        return hjson.load(f, object_pairs_hook=_no_duplicates)


def data_parallel_size(d: dict, mpu=None, mesh_device=None) -> int:
    """DeepSpeedConfig's world size, in its order: the mpu's data-parallel size (an mpu with only a
    sequence-parallel size: world ÷ that); mesh_device's "data_parallel" group; else world ÷ the
    config's sequence_parallel_size (HF's zero.init path, Ulysses), else the world."""
    world = dist.get_world_size()
    if mpu is not None:
        sp = None if hasattr(mpu, "get_data_parallel_world_size") else mpu.get_sequence_parallel_world_size()
        return mpu.get_data_parallel_world_size() if sp is None else _whole(world, sp, "the mpu's sequence-parallel size")
    if mesh_device is not None:
        return dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    if "sequence_parallel_size" in d:
        return _whole(world, d["sequence_parallel_size"], "config key 'sequence_parallel_size'")
    return world


def _whole(world: int, sp, what: str) -> int:
    if not isinstance(sp, int) or sp < 1 or world % sp:
        raise ValueError(f"{what} = {sp!r} does not divide the world size {world}: DeepSpeed would take a data-parallel "
                         f"size of {world}/{sp}, not a whole number of ranks")
    return world // sp


class DeepSpeedConfig:
    """`deepspeed.runtime.config.DeepSpeedConfig(config, mpu=None)`: the sections above plus the batch sizes."""

    def __init__(self, config, mpu=None, mesh_device=None):
        self._param_dict = read_config(config)
        on = dist.is_available() and dist.is_initialized()
        self.global_rank = dist.get_rank() if on else 0
        self.world_size = data_parallel_size(self._param_dict, mpu, mesh_device) if on else 1
        d = {k: v for k, v in self._param_dict.items() if k != "sequence_parallel_size"}   # applied just above
        op = d.get("gradient_allreduce_op", "mean")
        self.gradient_allreduce_op = op.lower() if isinstance(op, str) else op
        if self.gradient_allreduce_op not in ("mean", "sum"):
            raise ValueError(f"Invalid gradient_allreduce_op. Supported operations: ['mean', 'sum']. Got: {op!r}")
        self.zero_config = get_zero_config(d)
        self.zero_optimization_stage = self.zero_config.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.bfloat16_config = get_bfloat16_config(d)
        self.bfloat16_enabled = self.bfloat16_config.enabled
        if self.gradient_allreduce_op == "sum":    # DeepSpeed's _do_sanity_check, in its order
            for bad, what in ((self.zero_optimization_stage == 3, "ZeRO stage 3"),
                              (self.zero_config.zenflow is not None, "ZenFlow"),
                              (bool(d.get("compile", {}).get("deepcompile")), "DeepCompile")):
                if bad:
                    raise ValueError(f"gradient_allreduce_op='sum' is not supported with {what}")
        self.ringzero = load_config(d, int(self.world_size))
        self.train_batch_size = self.ringzero.train_batch_size
        self.train_micro_batch_size_per_gpu = self.ringzero.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = self.ringzero.gradient_accumulation_steps
        self.gradient_clipping = self.ringzero.gradient_clipping
        self.fp16_enabled = self.ringzero.fp16.enabled
