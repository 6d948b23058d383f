"""tensor_parallel's engine, built on the textbook layers: parallelize.py (shard a Hugging Face
DistilBERT or an MLP stack in place over a process group), state_dict.py (gather_state_dict /
load_full_state_dict / sharded_numel), uneven.py (gathering slices of unequal size), ulysses.py
(all-to-all sequence parallelism), formulas.py (bytes, parameters, activations).
"""
