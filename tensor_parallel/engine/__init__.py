"""tensor_parallel's engine: applying the textbook layers to real models, and accounting.

parallelize.py (shard a Hugging Face model in place; gather_state_dict / load_full_state_dict),
ulysses.py (all-to-all sequence parallelism), formulas.py (bytes, parameters, activations).
"""
