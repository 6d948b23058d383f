"""Tiny models with tied / shared parameters, built from config (no downloads), for parity tests.

    python -m pytest -q tests/test_recipes_tied.py

t5       T5ForConditionalGeneration: `shared` is the embedding of the encoder AND the decoder AND
         the LM head (tie_word_embeddings): one Parameter held by four modules.
gpt2     GPT2LMHeadModel: lm_head.weight is wte.weight.
Every dropout is 0 so two engines see the same function. Cost: ~20 k parameters each.
"""
from __future__ import annotations

import torch

VOCAB = 64


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration   # optional dependency: transformers
    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                   dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel   # optional dependency: transformers
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=VOCAB - 1,
                     eos_token_id=VOCAB - 1)
    return GPT2LMHeadModel(cfg)


def batches(kind: str, n: int, rows: int, seed: int = 1, seq: int = 10) -> list[dict]:
    """n global micro-batches of `rows` rows for `kind` ('t5' or 'gpt2')."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
        if kind == "t5":
            labels = torch.randint(1, VOCAB, (rows, seq // 2), generator=g)
            labels[: rows // 2, -1] = -100            # some ignored targets, as padding would give
            out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        else:
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out
