"""DeepSpeed's ZeRO-1/2 flat parameter buffers (`engine.optimizer.bit16_groups_flat`), as live views.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    (zero_layout.install calls install(engine) after deepspeed.initialize)

DeepSpeed's stage_1_and_2.py keeps one flat, detached buffer per param group holding that group's
model parameters (bf16/fp16, or fp32 when mixed precision is off), each parameter a view into it.
ringzero's stages 1-2 hold the same thing (stage1.py: one flat buffer per param group, each
parameter a view into it): engine.stage.flat[g]. The view is read from the engine on every access,
so it never goes stale. One difference in layout, not in values: ringzero pads each unit (bucket)
to a multiple of the ranks, DeepSpeed pads the group once, so the lengths differ by the padding.
Cost: none until read.
"""
from __future__ import annotations


def install(engine, live) -> None:
    """engine.optimizer.bit16_groups_flat at stages 1-2 (nothing at other stages, as DeepSpeed); `live`
    wraps a getter as a read-only sequence (zero_layout.Live)."""
    if engine.stage_id in (1, 2) and hasattr(engine.stage, "flat"):
        engine.optimizer.bit16_groups_flat = live(lambda: engine.stage.flat)
