"""ringzero.tensor_parallel: Megatron-style tensor and sequence parallelism on primitives.

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2

    comm.py            f / g and the sequence-parallel pair (autograd functions, derivations)
    layers.py          ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    cross_entropy.py   vocab-parallel cross-entropy (never the full logits)
    parallelize.py     parallelize(model, group, sequence_parallel), gather_state_dict / load_full_state_dict
    ulysses.py         Ulysses attention: heads ↔ sequence with all-to-all
    formulas.py        bytes per layer (via primitives.engine.cost), parameters per rank, Megatron's activations
    memory.py          activation / parameter bytes measured vs formulas.py
    accuracy.py        the pretrained classifier's test-split predictions, sharded vs one process
    parity.py          sharded vs one process (logits, loss, grads, params after AdamW), as a table
    (figures/ch10_tensor_parallel.py: the mesh picture and who holds which slice, matplotlib)
    pipeline.py        DistilBERT as pipeline stages with tensor-parallel blocks (for pipeline_parallel)
    train.py           the demo: dp × tp (× pp) on the offline DistilBERT classifier
    train3d.py         its --pp > 1 loop: pipeline_parallel's engine on the dp × pp × tp mesh

The process groups come from primitives.mesh (dp × pp × tp, tp fastest).
"""
from tensor_parallel.comm import copy_to_tp, gather_seq, reduce_from_tp, scatter_seq
from tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPError, VocabParallelEmbedding
from tensor_parallel.engine.parallelize import gather_state_dict, load_full_state_dict, parallelize, sharded_numel

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_seq", "scatter_seq", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "parallelize", "gather_state_dict",
           "load_full_state_dict",
           "sharded_numel", "TPError"]
