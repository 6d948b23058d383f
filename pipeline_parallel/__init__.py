"""ringzero.pipeline_parallel: pipeline parallelism on primitives' point-to-point messages.

    module.py      PipelineModule, LayerSpec, TiedLayerSpec (deepspeed.pipe's constructor semantics)
    partition.py   uniform / balanced splits (pure)
    schedules/     naive, GPipe, 1F1B, interleaved 1F1B: pure functions → instruction lists
    executor.py    runs one rank's instructions over the Communicator (isend / irecv, in the ledger)
    engine.py      initialize() / train_batch() / eval_batch(), pp × dp on primitives.mesh
    tied.py        tied weights across stages
    parity.py      vs one process and vs DeepSpeed's pipeline engine
"""
from pipeline_parallel.engine.pipe_engine import PipelineEngine, PipelineError, initialize
from pipeline_parallel.engine.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "initialize", "PipelineEngine", "PipelineError"]
