"""The `deepspeed.checkpoint` part of served.py's table: what ringzero serves of DeepSpeed's checkpoint
package (its 3D descriptors and reshape, checkpoint_3d*.py; the universal checkpoint, ds_to_universal.py and
engine/checkpoint_universal.py) and what it refuses, one line each, with the same conventions as served.py
(names → "module:attribute" strings, imported on first use).

    python -m zero_from_scratch.as_deepspeed --list | grep deepspeed.checkpoint

Cost: building three dicts at import.
"""
from __future__ import annotations

from zero_from_scratch.as_deepspeed.constants import CHECKPOINT_KEYS

_R = "zero_from_scratch.as_deepspeed"
_E = "zero_from_scratch.engine"
_CKPT_KEYS = tuple(CHECKPOINT_KEYS)
MODULES: tuple = ()
SERVED: dict[str, str] = {}
REFUSED: dict[str, tuple[str, str]] = {}

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

# -- the universal checkpoint: ds_to_universal (as_deepspeed/ds_to_universal.py) converts a data-parallel ZeRO
# folder; "checkpoint": {"load_universal": true} loads it (engine/checkpoint_universal.py). Tensor-parallel /
# AutoTP slices are refused: ringzero refuses AutoTP training (the tensor_parallel key), so it writes none.
MODULES += ("deepspeed.checkpoint.ds_to_universal", "deepspeed.checkpoint.universal_checkpoint")
SERVED.update({f"deepspeed.checkpoint.ds_to_universal.{n}": f"{_R}.ds_to_universal:{n}"   # main's steps, by name
               for n in ("main", "parse_arguments", "dp_index_to_str", "atoi", "natural_keys", "DeepSpeedCheckpoint",
                         "_get_checkpoint_files", "_get_optim_files", "_filter_zero3_optim_files",
                         "_get_model_state_files", "_is_expert_model_state_file", "_get_zero3_model_state_files",
                         "_get_zero_stage", "_inject_missing_state", "_check_for_required_state",
                         "_save_optimizer_state", "_save_optimizer_state_stage3")})
SERVED.update({f"deepspeed.checkpoint.ds_to_universal.{n}": f"{_R}.ds_to_universal_checks:{n}"
               for n in ("_aggregate_autoep_zero12_metadata", "_validate_autotp_conversion_support")})
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
