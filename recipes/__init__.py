"""Fine-tuning recipes on top of the engines: LoRA adapters (lora.py), a seq2seq task (seq2seq/).

    python -m pytest -q tests/test_recipes_lora.py
"""
