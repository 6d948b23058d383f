"""pipeline_parallel: pipeline parallelism on a Communicator's point-to-point messages.

Textbook (no engine imports): schedules/ (Instruction, naive, GPipe, 1F1B, interleaved as pure functions),
partition.py (layers → stages), executor.py (one rank's instruction list, real tensors).
Engine (engine/): DeepSpeed's pipeline API built on it (initialize, train_batch, PipelineModule,
the guarded executor, tied weights, simulator, nccl ordering). models/: llama as pipeline layers.
train.py: the demo (parity/pipeline.py: the checks). convert.py: HF ↔ pipeline weights (the llama
trainer that uses them: recipes/train_llm.py).
"""
import importlib

_ENGINE = {"PipelineModule": "pipeline_parallel.engine.module", "LayerSpec": "pipeline_parallel.engine.module",
           "TiedLayerSpec": "pipeline_parallel.engine.module", "initialize": "pipeline_parallel.engine.ds_pipe",
           "PipelineEngine": "pipeline_parallel.engine.pipe_engine", "PipelineError": "pipeline_parallel.engine.pipe_engine",
           **{n: "pipeline_parallel.engine.topology" for n in ("ProcessTopology", "PipeDataParallelTopology",
                                                             "PipeModelDataParallelTopology")}}

__all__ = list(_ENGINE)


def __getattr__(name):
    # PEP 562: the engine's names load on first use, so importing a textbook module loads no engine module
    if name in _ENGINE:
        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'pipeline_parallel' has no attribute {name!r}")
