"""Offline stand-ins for the hub checkpoints accelerate's DeepSpeed tests load: tiny models built from configs.

    python -m tests.hf_suites.hub_standins [DIR]      (writes the cache, default under /tmp; run.py does it first)

The tests load `sshleifer/tiny-gpt2`, `hf-internal-testing/tiny-random-gpt2` and `gpt2` with
`from_pretrained`, and read the configs of `apple/mobilevit-xx-small` and
`peft-internal-testing/tiny-random-qwen-1.5-MoE`; transformers' load `patrickvonplaten/t5-tiny-random`,
`hf-internal-testing/tiny-random-gptj` and `sshleifer/tiny-gpt2`, and the scripts its slow tests launch
(`scripts/train.py`, `scripts/torchrun_env_check.py`) `trl-internal-testing/tiny-Qwen2ForCausalLM-2.5` with its
tokenizer. The tiny ones are random on the hub too; here
each is built from its config (its sizes as published) with seeded random weights and written into a
Hugging Face cache laid out as the hub client reads it offline (HF_HUB_CACHE, HF_HUB_OFFLINE=1). `gpt2`'s
stand-in keeps GPT-2's architecture and vocabulary at 2 layers of width 64 (the tests read sizes from
`model.config`, never a weight's value). The Qwen2 stand-in's tokenizer is character-level (a BPE
without merges over printable ASCII, eos `<|endoftext|>` as Qwen's): the scripts only tokenize English
sentences and pad to a fixed length, so the model's vocabulary is cut to 128 rows (Qwen's 151k would make
each CPU step's logits 1000 times larger for ids no text reaches). Both engines' runs read the same
files. A test that needs a tokenizer, a data set or a script's own download still fails offline and
is counted under "needs hub".
Cost: a few seconds, ~30 MB.
"""
from __future__ import annotations

import argparse
import os
import tempfile

REVISION = "0" * 40     # the snapshot name refs/main points at


def _configs() -> dict:
    from transformers import GPT2Config, GPTJConfig, MobileViTConfig, Qwen2Config, Qwen2MoeConfig, T5Config
    return {
        "sshleifer/tiny-gpt2": GPT2Config(n_embd=2, n_head=2, n_layer=2, vocab_size=50257, n_positions=1024),
        "hf-internal-testing/tiny-random-gpt2": GPT2Config(n_embd=32, n_head=4, n_layer=5, vocab_size=1000,
                                                           n_positions=512),
        "gpt2": GPT2Config(n_embd=64, n_head=2, n_layer=2, vocab_size=50257, n_positions=1024),
        "apple/mobilevit-xx-small": MobileViTConfig(hidden_sizes=[64, 80, 96],
                                                    neck_hidden_sizes=[16, 16, 24, 48, 64, 80, 320]),
        "peft-internal-testing/tiny-random-qwen-1.5-MoE": Qwen2MoeConfig(
            vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            shared_expert_intermediate_size=16),
        # transformers' DeepSpeed tests: T5 and GPT-J loaded under ZeRO-3's zero.Init
        "patrickvonplaten/t5-tiny-random": T5Config(vocab_size=32128, d_model=64, d_kv=8, d_ff=256, num_layers=2,
                                                    num_heads=4),
        "hf-internal-testing/tiny-random-gptj": GPTJConfig(vocab_size=1000, n_embd=32, n_head=4, n_layer=5,
                                                           rotary_dim=4, n_positions=512),
        # transformers' slow DeepSpeed tests: scripts/train.py and torchrun_env_check.py under `accelerate launch`
        QWEN2: Qwen2Config(vocab_size=128, hidden_size=8, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    }


QWEN2 = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
WITH_TOKENIZER = (QWEN2,)     # the scripts that load these call AutoTokenizer.from_pretrained(name) too


def _char_tokenizer():
    """Printable ASCII, one token per character (a BPE with no merges), eos as Qwen2's."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<|endoftext|>": 0, "<unk>": 1} | {chr(c): c - 30 for c in range(32, 127)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, [], unk_token="<unk>")),
                                   eos_token="<|endoftext|>", unk_token="<unk>")


def build(cache: str = os.path.join(tempfile.gettempdir(), "ringzero_hf_hub_standins")) -> str:
    """Write every stand-in under `cache` (a hub cache folder) unless there already; return it."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    for i, (name, config) in enumerate(_configs().items()):
        repo = os.path.join(cache, "models--" + name.replace("/", "--"))
        snap = os.path.join(repo, "snapshots", REVISION)
        if os.path.exists(os.path.join(snap, "config.json")):
            continue
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        torch.manual_seed(i)
        auto = AutoModel if "mobilevit" in name else AutoModelForSeq2SeqLM if "t5" in name else AutoModelForCausalLM
        auto.from_config(config).save_pretrained(snap)
        if name in WITH_TOKENIZER:
            _char_tokenizer().save_pretrained(snap)
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(REVISION)
    return cache


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", nargs="?", help="the hub cache folder to write (default: under the temp folder)")
    a = ap.parse_args(argv)
    print(build(*([a.cache] if a.cache else [])))


if __name__ == "__main__":
    main()
