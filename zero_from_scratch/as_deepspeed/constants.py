"""DeepSpeed constants and enums that clients import by name, with DeepSpeed 0.19.8's values.

    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum   (under the runner)

OffloadDeviceEnum   runtime/zero/offload_config.py: the offload devices, a str Enum ("none", "cpu",
                    "nvme"), so a config may hold either the member or its string.
MIN_SWAPPABLE_BYTES runtime/swap_tensor/utils.py: the smallest tensor (bytes) DeepSpeed's NVMe
                    swapper moves (MIN_AIO_BYTES, 1 MiB).
torch_info, version, git_hash, git_branch   deepspeed/git_version_info.py, as the installed build has them.
ADAM_OPTIMIZER ... DEEPSPEED_OPTIMIZERS, ADAM_W_MODE(_DEFAULT), TORCH_ADAM_PARAM   runtime/config.py's
                    optimizer names (the config's "optimizer.type" values, lower case) and keys.
CHECKPOINT_KEYS     checkpoint/constants.py's names of the checkpoint files' keys and name parts (the
                    ones engine/checkpoint_ds.py writes) and UNIVERSAL_CHECKPOINT_INFO, DeepSpeed's values.
Cost: none.
"""
from __future__ import annotations

from enum import Enum

MIN_SWAPPABLE_BYTES = 1024**2


class OffloadDeviceEnum(str, Enum):
    """ Enum for valid offload devices """
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# deepspeed/git_version_info.py: what the build recorded; a CPU build without build isolation records
# "0.0" for each version (what the installed 0.19.8 holds here), and DeepSpeed's own checks then ask torch
torch_info = {"version": "0.0", "bf16_support": False, "cuda_version": "0.0", "nccl_version": "0.0",
              "hip_version": "0.0"}
version = "0.19.8"
git_hash = None
git_branch = None

# runtime/zero/partition_parameters.py: the shape of a partitioned parameter's .data between uses
partitioned_param_data_shape = [0]

# deepspeed/runtime/lr_schedules.py: the config key names and schedule names (strings, DeepSpeed's values)
LR_SCHEDULE_NAMES = {
    "LR_SCHEDULE": "lr_schedule", "LR_RANGE_TEST": "LRRangeTest", "ONE_CYCLE": "OneCycle", "WARMUP_LR": "WarmupLR",
    "WARMUP_DECAY_LR": "WarmupDecayLR", "WARMUP_COSINE_LR": "WarmupCosineLR", "EDGE_VALUE": "edge_value",
    "MID_VALUE": "mid_value", "LR_RANGE_TEST_MIN_LR": "lr_range_test_min_lr",
    "LR_RANGE_TEST_STEP_RATE": "lr_range_test_step_rate", "LR_RANGE_TEST_STEP_SIZE": "lr_range_test_step_size",
    "LR_RANGE_TEST_STAIRCASE": "lr_range_test_staircase", "CYCLE_FIRST_STEP_SIZE": "cycle_first_step_size",
    "CYCLE_FIRST_STAIR_COUNT": "cycle_first_stair_count", "CYCLE_SECOND_STEP_SIZE": "cycle_second_step_size",
    "CYCLE_SECOND_STAIR_COUNT": "cycle_second_stair_count", "DECAY_STEP_SIZE": "decay_step_size",
    "CYCLE_MIN_LR": "cycle_min_lr", "CYCLE_MAX_LR": "cycle_max_lr", "DECAY_LR_RATE": "decay_lr_rate",
    "CYCLE_MIN_MOM": "cycle_min_mom", "CYCLE_MAX_MOM": "cycle_max_mom", "DECAY_MOM_RATE": "decay_mom_rate",
    "WARMUP_MIN_LR": "warmup_min_lr", "WARMUP_MAX_LR": "warmup_max_lr", "WARMUP_NUM_STEPS": "warmup_num_steps",
    "WARMUP_TYPE": "warmup_type", "WARMUP_LOG_RATE": "log", "WARMUP_LINEAR_RATE": "linear",
    "WARMUP_MIN_RATIO": "warmup_min_ratio", "COS_MIN_RATIO": "cos_min_ratio", "TOTAL_NUM_STEPS": "total_num_steps"}
globals().update(LR_SCHEDULE_NAMES)

# deepspeed.ops.__compatible_ops__: the ops ringzero serves (as torch code: optimizers.py) are compatible;
# the ones it refuses or lacks (cpu_adagrad, async_io, the shm/ccl comm ops) are not
COMPATIBLE_OPS = {"cpu_adam": True, "fused_adam": True, "cpu_lion": True, "fused_lion": True, "cpu_adagrad": False,
                  "async_io": False, "deepspeed_shm_comm": False, "deepspeed_ccl_comm": False,
                  "deepspeed_not_implemented": False, "pin_memory": True}


class _OpBuilder:
    """deepspeed.ops.op_builder's builders, by NAME: is_compatible() from COMPATIBLE_OPS; nothing is built."""
    NAME = ""

    def is_compatible(self, verbose=False) -> bool:
        return COMPATIBLE_OPS.get(self.NAME, False)

    def load(self, verbose=True):
        raise NotImplementedError(f"deepspeed.ops.op_builder {type(self).__name__}.load(): ringzero builds no C++/CUDA "
                                  "op; the served optimizers run torch's code (engine/optimizers.py)")


OP_BUILDERS = {f"{name}Builder": type(f"{name}Builder", (_OpBuilder,), {"NAME": op}) for name, op in (
    ("CPUAdam", "cpu_adam"), ("FusedAdam", "fused_adam"), ("CPULion", "cpu_lion"), ("FusedLion", "fused_lion"),
    ("CPUAdagrad", "cpu_adagrad"), ("FusedLamb", "fused_lamb"))}
globals().update(OP_BUILDERS)


# runtime/config.py's optimizer names and keys
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER = \
    "muadam", "muadamw", "musgd", "lion", "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
TORCH_ADAM_PARAM, ADAM_W_MODE, ADAM_W_MODE_DEFAULT = "torch_adam", "adam_w_mode", True


# deepspeed/checkpoint/constants.py (the keys and file-name parts of engine/checkpoint_ds.py's files)
CHECKPOINT_KEYS = {
    "OPTIMIZER_STATE_DICT": "optimizer_state_dict", "FP32_FLAT_GROUPS": "fp32_flat_groups",
    "BASE_OPTIMIZER_STATE": "base_optimizer_state", "SINGLE_PARTITION_OF_FP32_GROUPS": "single_partition_of_fp32_groups",
    "PARAM_GROUPS": "param_groups", "GROUP_PADDINGS": "group_paddings", "PARAM_ALIGNMENT_PADDINGS": "param_alignment_paddings",
    "PARTITION_COUNT": "partition_count", "ZERO_STAGE": "zero_stage", "CLIP_GRAD": "clip_grad", "LOSS_SCALER": "loss_scaler",
    "PARAM_SHAPES": "param_shapes", "BUFFER_NAMES": "buffer_names", "FROZEN_PARAM_SHAPES": "frozen_param_shapes",
    "FROZEN_PARAM_FRAGMENTS": "frozen_param_fragments", "MODEL_FILE_PREFIX": "mp_rank_", "ZERO_FILE_PREFIX": "zero_pp_rank_",
    "OPTIM_FILE_SUFFIX": "_optim_states.pt", "MODEL_FILE_SUFFIX": "_model_states.pt",
    "BF16_ZERO_FILE_PREFIX": "bf16_zero_pp_rank_", "FP16_ZERO_FILE_PREFIX": "fp16_zero_pp_rank_",
    "CHECKPOINT_PARALLEL_DIMS": "checkpoint_parallel_dimensions", "CHECKPOINT_PP_DEGREE": "pp_degree",
    "CHECKPOINT_TP_DEGREE": "tp_degree", "DS_VERSION": "ds_version", "UNIVERSAL_CHECKPOINT_INFO": "universal_checkpoint_info",
    "LAYER_FILE_PREFIX": "layer_", "AUTOEP_LAYERS_KEY": "ds_autoep_layers", "AUTOEP_LAYERS_KEY_LEGACY": "autoep_layers"}
globals().update(CHECKPOINT_KEYS)
