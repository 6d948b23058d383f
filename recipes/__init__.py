"""Fine-tuning recipes on top of the engines: LoRA's memory per stage (lora.py; the adapters are
zero_from_scratch/engine/lora.py), tiny tied-weight models (tiny.py), a seq2seq task (seq2seq/), a llama
trained in pipeline mode from JSON (train_llm.py, its data: llm_data.py).

    python -m pytest -q tests/test_recipes_lora.py
"""
