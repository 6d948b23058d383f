"""deepspeed.OnDevice: build a model's tensors directly on a device (often "meta") in a dtype.

    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):      (under the runner)
        model = MyModel()            # every parameter: meta, float16; no memory allocated

DeepSpeed's (utils/init_on_device.py) swaps torch.empty/zeros/ones/full and Tensor.__new__ for
versions that pass the device and cast floating-point results to `dtype`. Here torch's own two
switches do it: the device context (`with torch.device(device)`, every factory without an explicit
device) and the default floating-point dtype (every factory without an explicit dtype), both put
back on exit. Same result for modules built from torch's layers; where a script asks for an
explicit dtype=torch.float32 inside the block, DeepSpeed casts it and this does not. Cost: none.
"""
from __future__ import annotations

import torch


class OnDevice:
    def __init__(self, dtype, device="meta", enabled: bool = True):
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._device_ctx, self._old_dtype = None, None

    def __enter__(self):
        if not self.enabled:
            return self
        self._old_dtype = torch.get_default_dtype()
        if self.dtype is not None and self.dtype.is_floating_point:
            torch.set_default_dtype(self.dtype)
        self._device_ctx = torch.device(self.device)
        self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return
        self._device_ctx.__exit__(*exc)
        torch.set_default_dtype(self._old_dtype)
