"""Fine-tuning recipes on top of the engines: LoRA's memory per stage (lora.py; the adapters are
zero_from_scratch/engine/lora.py), tiny tied-weight models (tiny.py), a seq2seq task (seq2seq/).

    python -m pytest -q tests/test_recipes_lora.py
"""
