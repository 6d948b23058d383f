"""ringzero.tensor_parallel: Megatron-style tensor and sequence parallelism over a `comm`.

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2

The textbook (read in this order):
    comm.py            f / g and the sequence-parallel pair (autograd functions, derivations)
    layers.py          ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    cross_entropy.py   vocab-parallel cross-entropy (never the full logits)
The engine (engine/, each file named in engine/__init__.py): parallelize, state dicts, Ulysses.
parity/tp.py compares a parallelized model with one process (`python -m parity.tp`).
The applications (dp × tp × pp training, accuracy, memory) live in classification/parallel/.
"""
import importlib

from tensor_parallel.comm import copy_to_tp, gather_seq, reduce_from_tp, scatter_seq
from tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPError, VocabParallelEmbedding

# the engine's names resolve on first use, so importing a textbook module loads no engine module
_ENGINE = {"parallelize": "tensor_parallel.engine.parallelize",
           "gather_state_dict": "tensor_parallel.engine.state_dict",
           "load_full_state_dict": "tensor_parallel.engine.state_dict",
           "sharded_numel": "tensor_parallel.engine.state_dict"}


def __getattr__(name):   # PEP 562: a lazy engine name
    if name in _ENGINE:
        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'tensor_parallel' has no attribute {name!r}")


__all__ = ["copy_to_tp", "reduce_from_tp", "gather_seq", "scatter_seq", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "parallelize", "gather_state_dict",
           "load_full_state_dict", "sharded_numel", "TPError"]
