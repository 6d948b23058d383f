"""ringzero.pipeline_parallel: pipeline parallelism on primitives' point-to-point messages.

    module.py      PipelineModule, LayerSpec, TiedLayerSpec (deepspeed.pipe's constructor semantics)
    partition.py   uniform / balanced splits (pure)
    schedules/     naive, GPipe, 1F1B, interleaved 1F1B: pure functions → instruction lists
"""
from pipeline_parallel.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
