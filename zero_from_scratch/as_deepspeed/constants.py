"""DeepSpeed constants and enums that clients import by name, with DeepSpeed 0.19.8's values.

    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum   (under the runner)

OffloadDeviceEnum   runtime/zero/offload_config.py: the offload devices, a str Enum ("none", "cpu",
                    "nvme"), so a config may hold either the member or its string.
MIN_SWAPPABLE_BYTES runtime/swap_tensor/utils.py: the smallest tensor (bytes) DeepSpeed's NVMe
                    swapper moves (MIN_AIO_BYTES, 1 MiB). Cost: none.
"""
from __future__ import annotations

from enum import Enum

MIN_SWAPPABLE_BYTES = 1024**2


class OffloadDeviceEnum(str, Enum):
    """ Enum for valid offload devices """
    none = "none"
    cpu = "cpu"
    nvme = "nvme"
