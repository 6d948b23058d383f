"""ringzero.pipeline_parallel: pipeline parallelism on a Communicator's point-to-point messages.

The textbook (READING.md names these files; they import no engine module):
    schedules/     naive, GPipe, 1F1B, interleaved 1F1B: pure functions → instruction lists (Op)
    partition.py   uniform / balanced splits of the layers into stages
    executor.py    runs one rank's instruction list with real tensors over comm.isend / irecv
The engine (engine/), DeepSpeed's pipeline API built on it:
    pipe_engine.py initialize() / train_batch() / eval_batch(), pp × dp on primitives.mesh
    draining.py    the textbook executor, guarded: errors drain instead of hanging, timings, ledger
    module.py      PipelineModule, LayerSpec, TiedLayerSpec (deepspeed.pipe's constructor semantics)
    tied.py, config.py, simulator.py, nccl_order.py, timeline.py, model.py, reviews.py
parity.py compares with one process and DeepSpeed's pipeline engine; train.py is the demo.
"""
import importlib

_ENGINE = {"PipelineModule": "pipeline_parallel.engine.module", "LayerSpec": "pipeline_parallel.engine.module",
           "TiedLayerSpec": "pipeline_parallel.engine.module", "initialize": "pipeline_parallel.engine.pipe_engine",
           "PipelineEngine": "pipeline_parallel.engine.pipe_engine", "PipelineError": "pipeline_parallel.engine.pipe_engine"}

__all__ = list(_ENGINE)


def __getattr__(name):
    # PEP 562: the engine's names load on first use, so importing a textbook module loads no engine module
    if name in _ENGINE:
        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'pipeline_parallel' has no attribute {name!r}")
