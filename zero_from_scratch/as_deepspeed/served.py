"""The table: each `deepspeed` name a client may use → the ringzero object that serves it, or why not.

    python -m zero_from_scratch.as_deepspeed --list        (prints this table, resolved now)

SERVED maps a DeepSpeed dotted name to "module:attribute" — a STRING, imported on first use
(importlib in finder.py). That keeps two promises: a name whose ringzero code lands later is
served from then on without touching this file, and the package arrows hold (zero_from_scratch
may not import pipeline_parallel; the runner resolves pipeline_parallel's names by table only
when a script asks for them). A served name whose target is missing fails on lookup with
NotServedAttributeError. "module:*" serves every name in that module's __all__.
REFUSED lists DeepSpeed names real clients import at module level that ringzero does not serve:
they import, and fail at their first call or attribute with one line (what DeepSpeed would
have done, the nearest ringzero way). Any other name fails on lookup. Cost: a dict lookup.
"""
from __future__ import annotations

from zero_from_scratch.as_deepspeed.constants import CHECKPOINT_KEYS

VERSION = "0.19.8"   # the DeepSpeed release whose API (and quirks) the runner follows
_R = "zero_from_scratch.as_deepspeed"
_E = "zero_from_scratch.engine"
_PIPE = "pipeline_parallel.engine.ds_pipe"

# the modules `import deepspeed.X` finds (every one a package, so deeper imports are looked up here too)
MODULES = ("deepspeed", "deepspeed.comm", "deepspeed.accelerator", "deepspeed.zero", "deepspeed.utils",
           "deepspeed.utils.logging", "deepspeed.utils.zero_to_fp32", "deepspeed.runtime", "deepspeed.runtime.utils",
           "deepspeed.runtime.lr_schedules", "deepspeed.runtime.engine", "deepspeed.runtime.dataloader",
           "deepspeed.runtime.zero", "deepspeed.runtime.zero.partition_parameters", "deepspeed.runtime.zero.utils", "deepspeed.runtime.zero.tiling",
           "deepspeed.runtime.zero.parameter_offload", "deepspeed.runtime.zero.linear",
           "deepspeed.runtime.zero.leaf_module_config", "deepspeed.ops",
           "deepspeed.ops.adam", "deepspeed.ops.lion", "deepspeed.ops.adagrad", "deepspeed.ops.op_builder", "deepspeed.ops.aio",
           "deepspeed.runtime.zero.offload_config", "deepspeed.runtime.zero.offload_states", "deepspeed.runtime.swap_tensor",
           "deepspeed.runtime.base_optimizer", "deepspeed.runtime.bf16_optimizer", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.fp16",
           "deepspeed.runtime.fp16.fused_optimizer", "deepspeed.runtime.fp16.unfused_optimizer",
           "deepspeed.ops.sparse_attention", "deepspeed.pipe", "deepspeed.runtime.pipe", "deepspeed.runtime.pipe.topology",
           "deepspeed.runtime.pipe.module", "deepspeed.runtime.pipe.schedule", "deepspeed.runtime.comm", "deepspeed.runtime.comm.coalesced_collectives", "deepspeed.checkpointing", "deepspeed.runtime.activation_checkpointing",
           "deepspeed.runtime.activation_checkpointing.checkpointing",
           "deepspeed.runtime.activation_checkpointing.offload_activations", "deepspeed.runtime.config_utils", "deepspeed.runtime.config", "deepspeed.runtime.zero.config",
           "deepspeed.runtime.precision_config", "deepspeed.runtime.constants", "deepspeed.utils.torch", "deepspeed.moe", "deepspeed.moe.utils",
           "deepspeed.moe.layer", "deepspeed.checkpoint", "deepspeed.checkpoint.utils", "deepspeed.compression",
           "deepspeed.compression.compress", "deepspeed.module_inject", "deepspeed.inference", "deepspeed.git_version_info",
           "deepspeed.utils.pin_memory_tracker", "deepspeed.utils.groups", "deepspeed.checkpoint.constants")

_LR = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "VALID_LR_SCHEDULES")
_LR_KEYS = ("LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR", "EDGE_VALUE",
            "MID_VALUE", "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE",
            "LR_RANGE_TEST_STAIRCASE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE",
            "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE", "CYCLE_MIN_MOM",
            "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE",
            "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO", "TOTAL_NUM_STEPS")
_CONFIG_NAMES = ("ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "MUADAM_OPTIMIZER",
                 "MUADAMW_OPTIMIZER", "MUSGD_OPTIMIZER", "LION_OPTIMIZER", "MUON_OPTIMIZER", "DEEPSPEED_OPTIMIZERS",
                 "TORCH_ADAM_PARAM", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT")
_BUILDERS = ("CPUAdamBuilder", "FusedAdamBuilder", "CPULionBuilder", "FusedLionBuilder", "CPUAdagradBuilder",
             "FusedLambBuilder")
_SAFE = tuple(f"safe_{a}_{c}_{b}" for a in ("get", "set") for c in ("full", "local")
              for b in ("fp32_param", "grad", "optimizer_state")) + ("safe_update_full_grad_vectorized",)
_LEAF = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter",
         "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")
_PIPE_NAMES = ("PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
               "PipeModelDataParallelTopology")
_CKPT_KEYS = tuple(CHECKPOINT_KEYS)
_TOPO = "pipeline_parallel.engine.topology"
_TOPO_NAMES = ("ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
               "_prime_factors")

# DeepSpeed name → "ringzero module:attribute"
SERVED: dict[str, str] = {
    "deepspeed.initialize": f"{_R}.top:initialize",
    **{n: f"{_R}.more_on_device:OnDevice" for n in ("deepspeed.OnDevice", "deepspeed.utils.OnDevice")},
    "deepspeed.init_distributed": f"{_R}.top:init_distributed",
    "deepspeed.add_config_arguments": f"{_R}.top:add_config_arguments",
    "deepspeed.DeepSpeedEngine": "zero_from_scratch:ZeroEngine",
    "deepspeed.runtime.base_optimizer.ZeROOptimizer": f"{_E}.z_ua_boundary:ZeROOptimizer",
    "deepspeed.DeepSpeedConfigError": f"{_E}.checkpoint_read:DeepSpeedConfigError",
    "deepspeed.get_accelerator": f"{_R}.accelerator:get_accelerator",
    "deepspeed.logger": f"{_R}.utils:logger",
    "deepspeed.log_dist": f"{_R}.utils:log_dist",
    "deepspeed.PipelineModule": f"{_PIPE}:PipelineModule",
    "deepspeed.comm.*": f"{_R}.comm:*",
    "deepspeed.accelerator.get_accelerator": f"{_R}.accelerator:get_accelerator",
    "deepspeed.accelerator.is_current_accelerator_supported": f"{_R}.accelerator:is_current_accelerator_supported",
    **{f"deepspeed.git_version_info.{n}": f"{_R}.constants:{n}" for n in ("torch_info", "version", "git_hash", "git_branch")},
    "deepspeed.zero.Init": f"{_R}.zero_init:Init",
    "deepspeed.zero.GatheredParameters": f"{_E}.zero_init:GatheredParameters",
    "deepspeed.zero.register_external_parameter": "zero_from_scratch:register_external_parameter",
    "deepspeed.runtime.zero.Init": f"{_R}.zero_init:Init",
    "deepspeed.runtime.zero.GatheredParameters": f"{_E}.zero_init:GatheredParameters",
    "deepspeed.runtime.zero.register_external_parameter": "zero_from_scratch:register_external_parameter",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus": f"{_E}.zero_init:ZeroParamStatus",
    "deepspeed.runtime.zero.partition_parameters.partitioned_param_data_shape": f"{_R}.constants:partitioned_param_data_shape",
    "deepspeed.runtime.zero.partition_parameters.GatheredParameters": f"{_E}.zero_init:GatheredParameters",
    "deepspeed.runtime.zero.partition_parameters.Init": f"{_R}.zero_init:Init",
    "deepspeed.runtime.zero.partition_parameters._contradicting_single_rank_pg_error":
        f"{_E}.group_check:contradicting_single_rank_pg_error",
    "deepspeed.runtime.zero.tiling.*": f"{_R}.tiled:*",
    "deepspeed.runtime.zero.partition_parameters.CUDAQuantizer": f"{_R}.cuda_quantizer:CUDAQuantizer",
    "deepspeed.runtime.zero.partition_parameters.MultipleAllGatherHandles": f"{_E}.zero_partition:MultipleAllGatherHandles",
    **{f"deepspeed.runtime.zero.{m}.{n}": f"{_R}.z3lin_linear:{n}" for m, n in (  # DeepSpeed's ZeRO-3 Linear
        ("linear", "LinearFunctionForZeroStage3"), ("linear", "zero3_linear_wrap"),
        ("partition_parameters", "zero3_linear_wrap"), ("partition_parameters", "InsertPostInitMethodToModuleSubClasses"))},
    # transformers swaps torch.arange with these two around Init (integrations/deepspeed.py)
    **{f"deepspeed.runtime.zero.partition_parameters.{n}": f"{_E}.zero_init:{n}"
       for n in ("_orig_torch_arange", "zero_wrapper_for_fp_tensor_constructor")},
    **{f"deepspeed.runtime.zero.utils.{n}": f"{_R}.zero_utils:{n}"
       for n in ("ZeRORuntimeException", "is_zero_param", "is_builtin_type", "isinstance_namedtuple")},
    **{f"deepspeed.runtime.zero.parameter_offload.{n}": f"{_E}.zero_ordered_dict:{n}"
       for n in ("ZeROOrderedDict", "ensure_zero_ordered_dict")},
    "deepspeed.runtime.zero.unwrap_model_for_generation": f"{_R}.zero_utils:unwrap_model_for_generation",
    "deepspeed.runtime.zero.stage3.unwrap_model_for_generation": f"{_R}.zero_utils:unwrap_model_for_generation",
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3": f"{_R}.zero3_optimizer:DeepSpeedZeroOptimizer_Stage3",
    **{f"deepspeed.runtime.{m}.count_used_parameters_in_backward": f"{_R}.utils:count_used_parameters_in_backward"
       for m in ("utils", "zero.stage_1_and_2", "zero.stage3")},    # the stages' import of it: the same function
    **{f"deepspeed.runtime.{m}.{c}": f"{_R}.optimizer_classes:{c}"
       for m, c in (("bf16_optimizer", "BF16_Optimizer"), ("zero.stage_1_and_2", "DeepSpeedZeroOptimizer"))},
    "deepspeed.runtime.utils.see_memory_usage": f"{_R}.utils:see_memory_usage",
    **{f"deepspeed.runtime.utils.{n}": f"{_R}.utils:{n}" for n in ("call_to_str", "prefix_sum_inc", "clip_grad_norm_")},
    "deepspeed.runtime.utils.partition_uniform": "pipeline_parallel.partition:uniform",
    "deepspeed.runtime.utils.PartitionedTensor": f"{_R}.partitioned_tensor:PartitionedTensor",
    "deepspeed.runtime.utils.partition_balanced": "pipeline_parallel.partition:balanced",
    "deepspeed.utils.torch.required_torch_version": f"{_R}.utils:required_torch_version",
    "deepspeed.runtime.pipe.schedule.*": "pipeline_parallel.engine.ds_schedule:*",
    "deepspeed.runtime.config_utils.DeepSpeedConfigModel": f"{_R}.config_model:DeepSpeedConfigModel",
    "deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced": f"{_R}.coalesced:reduce_scatter_coalesced",
    **{f"{m}.{n}": f"{_R}.checkpointing:{n}" for m in ("deepspeed.checkpointing",
                                                       "deepspeed.runtime.activation_checkpointing.checkpointing")
       for n in ("checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset")},
    **{f"deepspeed.runtime.activation_checkpointing.offload_activations.{n}": f"{_R}.offload_activations:{n}"
       for n in ("CheckpointHiddenStatesOffload", "get_checkpoint_hidden_states_offloading_ctx_manager",
                 "CheckpointActivationOffloadStats", "patch_gradient_checkpointing_layer_marker")},
    **{f"deepspeed.runtime.config.{n}": f"{_R}.constants:{n}" for n in _CONFIG_NAMES},
    "deepspeed.runtime.config.DeepSpeedConfigError": f"{_E}.checkpoint_read:DeepSpeedConfigError",
    "deepspeed.runtime.config.get_gradient_clipping": f"{_R}.more_config:get_gradient_clipping",
    "deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT": f"{_R}.more_config:GRADIENT_CLIPPING_DEFAULT",
    **{n: f"{_R}.config_objects:{n.rpartition('.')[2]}" for n in (
        "deepspeed.DeepSpeedConfig", "deepspeed.runtime.config.DeepSpeedConfig", "deepspeed.runtime.precision_config.get_bfloat16_config",
        "deepspeed.runtime.precision_config.DeepSpeedBF16Config", "deepspeed.runtime.zero.config.get_zero_config",
        *(f"deepspeed.runtime.zero.config.DeepSpeedZero{c}Config" for c in ("", "OffloadParam", "OffloadOptimizer")),
        *(f"deepspeed.runtime.zero.offload_config.DeepSpeedZero{c}Config" for c in ("OffloadParam", "OffloadOptimizer")),
        "deepspeed.runtime.zero.leaf_module_config.DeepSpeedZeroLeafModuleConfig")},
    "deepspeed.utils.logger": f"{_R}.utils:logger",
    "deepspeed.utils.log_dist": f"{_R}.utils:log_dist",
    "deepspeed.utils.logging.logger": f"{_R}.utils:logger",
    "deepspeed.utils.logging.log_dist": f"{_R}.utils:log_dist",
    "deepspeed.utils.RepeatingLoader": f"{_E}.dataloader:RepeatingLoader",
    "deepspeed.runtime.dataloader.RepeatingLoader": f"{_E}.dataloader:RepeatingLoader",
    "deepspeed.runtime.utils.set_random_seed": f"{_R}.utils:set_random_seed",
    "deepspeed.runtime.engine.DeepSpeedEngine": "zero_from_scratch:ZeroEngine",
    **{f"deepspeed.checkpoint.utils.{n}": f"{_R}.utils:{n}" for n in ("clone_tensors_for_torch_save",
                                                                     "get_model_ckpt_name_for_rank")},
    "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer":
        f"{_R}.utils:split_params_into_different_moe_groups_for_optimizer",
    **{f"deepspeed.utils.{n}": f"{_E}.safe_api:{n}" for n in _SAFE},
    **{f"deepspeed.utils.{m}{n}": f"{_R}.utils:{n}" for m in ("", "logging.")
       for n in ("set_log_level_from_string", "get_log_level_from_string")},
    **{f"deepspeed.utils.pin_memory_tracker.{n}": f"{_R}.accelerator:{n}"
       for n in ("_fmt_bytes", "_tracker", "track_pinned_memory", "pinned_memory_summary")},
    "deepspeed.utils.groups._get_expert_parallel_ranks": f"{_R}.utils:_get_expert_parallel_ranks",
    # expert-parallel groups (no MoE layer) and the overflow / norm checks that reduce over them
    **{f"deepspeed.utils.groups.{n}": f"{_R}.expert_groups:{n}" for n in (
        "_create_expert_and_data_parallel", "_get_expert_parallel_group", "_get_expert_data_parallel_group",
        "_get_max_expert_parallel_group", "_get_max_expert_size", "_get_max_expert_size_name")},
    **{f"deepspeed.runtime.utils.{n}": f"{_R}.expert_groups:{n}"
       for n in ("CheckOverflow", "get_weight_norm", "is_invalid_grad_norm")},
    "deepspeed.moe.utils.is_moe_param": f"{_R}.expert_groups:is_moe_param",
    **{f"deepspeed.checkpoint.constants.{n}": f"{_R}.constants:{n}" for n in _CKPT_KEYS},
    "deepspeed.runtime.engine._checkpoint_parallel_metadata": f"{_E}.mpu:checkpoint_parallel_metadata",
    "deepspeed.runtime.zero.stage_1_and_2.dist": "deepspeed:comm",    # DeepSpeed's module-level `dist`: deepspeed.comm
    "deepspeed.runtime.zero.stage_1_and_2.IPGBucket": f"{_R}.more_layout:IPGBucket",
    "deepspeed.utils.zero_to_fp32.*": f"{_R}.zero_to_fp32:*",
    **{f"deepspeed.utils.{n}": f"{_E}.leaf:{n}" for n in _LEAF},
    **{f"deepspeed.runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_{n}": f"{_E}.leaf:DEFAULT_LEAF_MODULE_{n}"
       for n in ("CLASSES", "NAMES", "NAME_SUFFIXES")},
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum": f"{_R}.constants:OffloadDeviceEnum",
    **{f"deepspeed.runtime.zero.{n}": f"{_E}.offload_states:{n.rpartition('.')[2]}"
       for n in ("offload_config.OffloadStateTypeEnum", "offload_states.get_state_devices")},
    "deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES": f"{_R}.constants:MIN_SWAPPABLE_BYTES",
    **{f"deepspeed.runtime.lr_schedules.{n}": f"{_E}.lr_schedules:{n}" for n in _LR},
    **{f"deepspeed.runtime.lr_schedules.{n}": f"{_R}.constants:{n}" for n in _LR_KEYS},
    **{f"deepspeed.ops.op_builder.{n}": f"{_R}.constants:{n}" for n in _BUILDERS},
    **{f"deepspeed.ops.{m}.AsyncIOBuilder": f"{_R}.hf_ops:AsyncIOBuilder" for m in ("op_builder", "aio")},
    **{f"deepspeed.ops.adam.{n}": f"{_E}.optimizers:{n}" for n in ("FusedAdam", "DeepSpeedCPUAdam")},
    **{f"deepspeed.ops.lion.{n}": f"{_E}.optimizers:{n}" for n in ("FusedLion", "DeepSpeedCPULion")},
    **{f"deepspeed.pipe.{n}": f"{_PIPE}:{n}" for n in _PIPE_NAMES},
    **{f"deepspeed.runtime.pipe.{n}": f"{_PIPE}:{n}" for n in _PIPE_NAMES},
    **{f"deepspeed.runtime.pipe.module.{n}": f"{_PIPE}:{n}" for n in ("PipelineModule", "LayerSpec", "TiedLayerSpec")},
    **{f"deepspeed.runtime.pipe.topology.{n}": f"{_TOPO}:{n}" for n in _TOPO_NAMES},
}
# a served `deepspeed.initialize(model=PipelineModule)` goes here instead of zero_from_scratch.initialize
PIPELINE_INITIALIZE = f"{_PIPE}:initialize"
PIPELINE_MODULE = f"{_PIPE}:PipelineModule"

_NO_MOE = ("build mixture-of-experts layers with expert parallelism", "none: ringzero has no MoE; use a dense layer")
_KERNELS = ("fused CUDA transformer kernels", "the model's own torch layers (transformers, tensor_parallel/)")
_INFER = ("build an InferenceEngine (kernel injection, tensor-parallel inference)",
          "call the model itself; tensor_parallel/ shards its layers")
_DS_OPTIM = ("wrap the client optimizer in its own class, stepping fp32 partitions laid out its way",
             "engine.optimizer: a torch.optim.Optimizer over ringzero's shards (safe_get_full_* reads any parameter's)")
# DeepSpeed name → (what DeepSpeed would have done, the nearest ringzero way)
REFUSED: dict[str, tuple[str, str]] = {
    "deepspeed.init_inference": _INFER,
    "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer": _DS_OPTIM,
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer": _DS_OPTIM,
    "deepspeed.InferenceEngine": _INFER,
    "deepspeed.tp_model_init": ("shard a model for AutoTP training", "tensor_parallel/engine/parallelize.py"),
    "deepspeed.DeepSpeedTransformerLayer": _KERNELS,
    "deepspeed.DeepSpeedTransformerConfig": _KERNELS,
    "deepspeed.replace_transformer_layer": _INFER,
    "deepspeed.comm.TorchBackend": ("give the torch.distributed backend object", "deepspeed.comm's functions"),
    "deepspeed.moe.layer.MoE": _NO_MOE,
    "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad": ("run its C++ CPU Adagrad", "torch.optim.Adagrad"),
    "deepspeed.compression.compress.init_compression": ("apply compression-aware training", "none in ringzero"),
    "deepspeed.compression.compress.redundancy_clean": ("remove compressed redundancy", "none in ringzero"),
    "deepspeed.runtime.zero.partition_parameters.Init._partition_param_sec": (
        "copy this rank's slice of one gathered parameter into that parameter's own hpZ secondary tensor "
        "(param.ds_secondary_tensor, zero-padded)", "zero_hpz_partition_size in the config: ringzero's hpZ keeps "
        "one secondary shard per module unit, cut from the unit's forward all-gather (engine/hpz.py), so no "
        "parameter has a secondary tensor of its own to fill"),
}

# --- DeepSpeed's checkpoint descriptors and 3D reshape (as_deepspeed/checkpoint_3d*.py): one block ---
_C3, _C3Z, _C3R = f"{_R}.checkpoint_3d", f"{_R}.checkpoint_3d_zero", f"{_R}.checkpoint_3d_reader"
_C3_NAMES = {   # DeepSpeed module → the names it holds that ringzero serves, and from where
    "reshape_3d_utils": (_C3, ("model_3d_desc", "get_model_3d_descriptor", "get_model_3d_descriptor_from_metadata",
                               "flatten_dp_dimension", "unflatten_dp_dimension")),
    "reshape_meg_2d": (_C3, ("meg_2d_parallel_map", "reshape_meg_2d_parallel")),
    "reshape_utils": (_C3, ("basic_folder_validation", "get_files", "get_files_with_prefix", "sort_zero_files",
                            "get_zero_files", "partition_data")),
    "zero_checkpoint": (_C3Z, ("ZeROCheckpoint",)),
    "deepspeed_checkpoint": (_C3R, ("DeepSpeedCheckpoint",)),
}
MODULES += tuple(f"deepspeed.checkpoint.{m}" for m in _C3_NAMES)
SERVED.update({f"deepspeed.checkpoint.{m}.{n}": f"{src}:{n}" for m, (src, names) in _C3_NAMES.items() for n in names})
SERVED.update({
    **{f"deepspeed.checkpoint.{n}": f"{_C3}:{n}" for n in ("model_3d_desc", "get_model_3d_descriptor",
                                                           "reshape_meg_2d_parallel")},
    **{f"deepspeed.checkpoint.{m}merge_state": f"{_C3Z}:merge_state" for m in ("", "reshape_utils.")},
    "deepspeed.checkpoint.ZeROCheckpoint": f"{_C3Z}:ZeROCheckpoint",
    "deepspeed.checkpoint.DeepSpeedCheckpoint": f"{_C3R}:DeepSpeedCheckpoint",
    **{f"deepspeed.checkpoint.{n}": f"{_R}.constants:{n}" for n in _CKPT_KEYS},   # its `from .constants import *`
    "deepspeed.checkpoint.get_model_ckpt_name_for_rank": f"{_R}.utils:get_model_ckpt_name_for_rank",
    **{f"deepspeed.checkpoint.{m}{n}": f"{_C3}:{n}" for m in ("", "utils.")
       for n in ("get_zero_ckpt_name_for_rank", "get_layer_ckpt_name_for_rank")},
})
# the rest of what deepspeed/checkpoint/__init__.py exports: keys of file formats ringzero does not write
_NO_KEY = "none: ringzero's checkpoint files carry only deepspeed.checkpoint.constants' served keys (CHECKPOINT_KEYS)"
_DS_ONLY_KEYS = {   # DeepSpeed's checkpoint/constants.py names → what DeepSpeed reads or writes under them
    "the universal checkpoint's per-parameter metadata and tensor-parallel patterns": (
        "AFFINE_MAP", "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS", "CAT_DIM", "PARAM", "PARAMETER_TO_AVERAGE_PATTERNS",
        "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "PARAMETER_WITH_SUB_PARAMS",
        "PARAM_SLICE_MAPPINGS", "PIPELINE_REPLICATED_PARAMETER_PATTERNS", "TP_REPLICATED_PARAMETER_PATTERNS",
        "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "VOCABULARY_PARAMETER_PATTERNS"),
    "the universal checkpoint's sub-parameter, vocabulary and fp32 entries": (
        "AFFINE_MAP_PARAMS", "AFFINE_MAP_VERSION", "BASE_OPTIMIZER_STATE_STEP", "DS_AUTOTP_UC_META", "FP32_GROUPS",
        "FP32_WEIGHT_KEY", "ORIGINAL_VOCAB_SIZE", "PADDED_VOCAB_SIZE", "PARAM_N_SUB_PARAMS", "SUB_PARAMS_SHAPE",
        "SUB_PARAM_SHAPE", "SUB_PARAM_SHARD_WIDTHS", "VOCAB_TENSOR"),
    "AutoEP expert-parallel (MoE) records and placements": (
        "AUTOEP_AFFINE_MAPS", "AUTOEP_EP_SIZE", "AUTOEP_EXPERT_KEY_PREFIX", "AUTOEP_EXPERT_PLACEMENT",
        "AUTOEP_NUM_EXPERTS", "AUTOEP_NUM_LOCAL_EXPERTS", "AUTOEP_PARAM_EP_RANK", "AUTOEP_PARAM_LOCAL_EXPERTS",
        "AUTOEP_PARAM_LOGICAL_SHAPE", "AUTOEP_PLACEMENT_EP_SIZE", "AUTOEP_PLACEMENT_EXPERTS",
        "AUTOEP_PLACEMENT_NUM_EXPERTS", "AUTOEP_PLACEMENT_RANK", "AUTOEP_PLACEMENT_RANKS", "AUTOEP_PLACEMENT_VERSION",
        "AUTOEP_PLACEMENT_VERSION_KEY", "AUTOEP_ZERO12_REQUIRED_FIELDS", "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY",
        "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION", "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY",
        "AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT", "DS_AUTOEP_UC_META", "EP_IS_EXPERT_PARAM", "EP_NUM_EXPERTS",
        "EXPERT_PARAMETER_PATTERNS"),
    "the folding (expert / tensor / ZeRO partition) metadata of MoE checkpoints": (
        "FOLDING_DISPATCH_STRATEGY", "FOLDING_EP_RANK", "FOLDING_EP_SIZE", "FOLDING_ETP_RANK", "FOLDING_ETP_SIZE",
        "FOLDING_FAMILY", "FOLDING_METADATA_KEY", "FOLDING_METADATA_VERSION", "FOLDING_PARAM_FAMILIES",
        "FOLDING_SHARED_EXPERT_PLACEMENT", "FOLDING_TP_RANK", "FOLDING_TP_SIZE", "FOLDING_ZERO_PARTITION_COUNT",
        "FOLDING_ZERO_PARTITION_GROUP", "FOLDING_ZERO_PARTITION_RANK"),
}
REFUSED.update({f"deepspeed.checkpoint.{m}{n}": (f"name a key of {what}", _NO_KEY)
                for what, names in _DS_ONLY_KEYS.items() for n in names for m in ("", "constants.")})
REFUSED.update({f"deepspeed.checkpoint.{n}": (what, "load_checkpoint of ringzero's or DeepSpeed's ZeRO folders")
                for n, what in (("enable_universal_checkpoint", "mark each parameter of a model for loading a "
                                 "universal checkpoint (ds_universal_checkpoint_info)"),
                                ("SubparamShape", "describe a fused parameter's sub-parameter shapes for the "
                                 "universal checkpoint"))})


def target_of(name: str) -> str | None:
    """The "module:attribute" serving `name`, else None (a "module:*" entry serves its module's __all__)."""
    if name in SERVED:
        return SERVED[name]
    parent, _, attr = name.rpartition(".")
    star = SERVED.get(f"{parent}.*")
    return f"{star[:-1]}{attr}" if star else None


# -- the universal checkpoint: ds_to_universal (as_deepspeed/ds_to_universal.py) converts a data-parallel ZeRO
# folder; "checkpoint": {"load_universal": true} loads it (engine/checkpoint_universal.py). Tensor-parallel /
# AutoTP slices are refused: ringzero refuses AutoTP training (the tensor_parallel key), so it writes none.
MODULES += ("deepspeed.checkpoint.ds_to_universal", "deepspeed.checkpoint.universal_checkpoint")
SERVED.update({f"deepspeed.checkpoint.ds_to_universal.{n}": f"{_R}.ds_to_universal:{n}"
               for n in ("main", "parse_arguments", "dp_index_to_str", "_aggregate_autoep_zero12_metadata",
                         "_validate_autotp_conversion_support")})
SERVED["deepspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO"] = f"{_R}.constants:UNIVERSAL_CHECKPOINT_INFO"  # re-exported there
SERVED.update({f"{m}.{n}": f"{_E}.checkpoint_universal_layout:{n}" for m in ("deepspeed.checkpoint", "deepspeed.checkpoint.constants")
               for n in ("PARAM", "CAT_DIM", "PARAM_SLICE_MAPPINGS", "UNIVERSAL_CHECKPOINT_VERSION_KEY",
                         "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS",
                         "VOCABULARY_PARAMETER_PATTERNS", "PIPELINE_REPLICATED_PARAMETER_PATTERNS",
                         "PARAMETER_TO_AVERAGE_PATTERNS", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
                         "TP_REPLICATED_PARAMETER_PATTERNS", "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0",
                         "PARAMETER_WITH_SUB_PARAMS", "AFFINE_MAP")})
_AUTOTP = ("none: ringzero refuses AutoTP training (the tensor_parallel key) and so never writes tensor-parallel "
           "slices; a data-parallel ZeRO folder converts with deepspeed.checkpoint.ds_to_universal.main")
REFUSED.update({f"deepspeed.checkpoint.ds_to_universal.{n}": (
    "merge or check AutoTP tensor-parallel slices of a parameter for the universal checkpoint", _AUTOTP)
    for n in ("merge_tp_slices", "_group_per_tp_shapes")})
REFUSED.update({f"deepspeed.checkpoint.ds_to_universal.{n}": (
    "write or merge one parameter's per-rank fragment files in its temp folder", "deepspeed.checkpoint."
    "ds_to_universal.main: ringzero converts from full tensors (checkpoint_ds.read_full), without fragment files")
    for n in ("_merge_zero_shards", "extract_zero_shards", "extract_zero_shards_stage3", "merge_zero3_slices")})
REFUSED.update({f"deepspeed.checkpoint.universal_checkpoint.{n}": (
    "cut a universal checkpoint's full tensor into this rank's AutoTP tensor-parallel slice / its optimizer's "
    "fragment", _AUTOTP + "; load it with \"checkpoint\": {\"load_universal\": true} (engine/checkpoint_universal.py)")
    for n in ("_resolve_autotp_partition", "_get_param_uc_restore_meta", "load_hp_checkpoint_state", "SubparamShape")})
# -- end of the universal checkpoint block
