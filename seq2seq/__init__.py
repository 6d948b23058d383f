"""seq2seq recipe: a small T5 built from config learns English-like questions → SQL-like queries.

    torchrun --standalone --nproc_per_node 2 seq2seq/train.py --engine zero
    deepspeed --num_gpus 2 seq2seq/train.py --config seq2seq/ds_config_zero3_offload.json
"""
