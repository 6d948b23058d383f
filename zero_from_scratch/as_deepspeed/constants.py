"""DeepSpeed constants and enums that clients import by name, with DeepSpeed 0.19.8's values.

    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum   (under the runner)

OffloadDeviceEnum   runtime/zero/offload_config.py: the offload devices, a str Enum ("none", "cpu",
                    "nvme"), so a config may hold either the member or its string.
MIN_SWAPPABLE_BYTES runtime/swap_tensor/utils.py: the smallest tensor (bytes) DeepSpeed's NVMe
                    swapper moves (MIN_AIO_BYTES, 1 MiB).
torch_info, version, git_hash, git_branch   deepspeed/git_version_info.py, as the installed build has them.
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
