"""Real model families as pipeline layer lists (engine code: imports transformers on first use).

    from pipeline_parallel.models import llama_layers, llama_model, llama_loss
    layers = llama_layers(llama_model("tiny"))            # embedding, decoder blocks, norm, LM head

llama.py: transformers' LlamaForCausalLM cut into one-tensor-in, one-tensor-out layers, usable as
the `layers=` of our PipelineModule and of DeepSpeed's. Cost: importing this package loads nothing.
"""
import importlib

_NAMES = {n: "pipeline_parallel.models.llama" for n in
          ("llama_layers", "llama_model", "llama_config", "llama_loss", "PRESETS", "LlamaEmbedPipe",
           "LlamaBlockPipe", "LlamaNormPipe", "LlamaHeadPipe")}

__all__ = list(_NAMES)


def __getattr__(name):
    # PEP 562: transformers loads only when a llama name is used
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'pipeline_parallel.models' has no attribute {name!r}")
