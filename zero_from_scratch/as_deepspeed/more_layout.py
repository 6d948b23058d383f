"""DeepSpeed's ZeRO-1/2 flat parameter buffers (`engine.optimizer.bit16_groups_flat`), as live views.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    (zero_layout.install calls install(engine) after deepspeed.initialize)

DeepSpeed's stage_1_and_2.py keeps one flat, detached buffer per param group holding that group's
model parameters (bf16/fp16, or fp32 when mixed precision is off), each parameter a view into it.
ringzero's stages 1-2 hold the same thing (stage1.py: one flat buffer per param group, each
parameter a view into it): engine.stage.flat[g]. The view is read from the engine on every access,
so it never goes stale. One difference in layout, not in values: ringzero pads each unit (bucket)
to a multiple of the ranks, DeepSpeed pads the group once, so the lengths differ by the padding.
install logs DeepSpeed's INFO line per group, "Flattening param group g on <device> (sufficient
memory)": ringzero always flattens on the parameters' device (DeepSpeed's other path, flattening on
the host when device memory is short, does not exist here).
IPGBucket is stage_1_and_2.py's data holder of one gradient bucket (DeepSpeed's fields and clear()),
served for scripts that build one; ringzero's engine keeps its buckets as units and never uses it.
Cost: none until read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_from_scratch.as_deepspeed.accelerator import get_accelerator
from zero_from_scratch.as_deepspeed.utils import logger


def install(engine, live) -> None:
    """engine.optimizer.bit16_groups_flat at stages 1-2 (nothing at other stages, as DeepSpeed); `live`
    wraps a getter as a read-only sequence (zero_layout.Live)."""
    if engine.stage_id in (1, 2) and hasattr(engine.stage, "flat"):
        engine.optimizer.bit16_groups_flat = live(lambda: engine.stage.flat)
        for g in range(len(engine.stage.flat)):
            logger.info(f"Flattening param group {g} on {get_accelerator().device_name()} (sufficient memory)")


@dataclass
class IPGBucket:
    """DeepSpeed's (runtime/zero/stage_1_and_2.py): one gradient bucket's buffers, parameters, gradients,
    element count, events and the streams that copied into it; clear() empties the current fill."""
    buffer: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    elements: int = 0
    index: int = 0
    has_moe_params: bool = False
    ready_events: dict = field(default_factory=dict)
    reuse_events: dict = field(default_factory=dict)
    copy_streams: set = field(default_factory=set)

    def clear(self) -> None:
        self.params.clear()
        self.grads.clear()
        self.elements = 0
        self.has_moe_params = False
        self.ready_events.clear()      # reuse_events kept, as DeepSpeed's
        self.copy_streams.clear()
