"""The offline DistilBERT classifier under tensor, sequence and pipeline parallelism (applications
of tensor_parallel and pipeline_parallel).

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2

train.py (the dp × tp (× pp) demo), loop3d.py (its --pp > 1 loop), tokens.py (the tokenized
rows both loops read), pipeline.py (DistilBERT as pipeline stages with tensor-parallel blocks),
accuracy.py (sharded = unsharded predictions), memory.py (activation and parameter memory vs
Megatron-SP's formulas).
"""
