"""TRL's SFTTrainer, DPOTrainer and RewardTrainer with LoRA under a DeepSpeed ZeRO config, offline, on 2 ranks.

    torchrun --nproc_per_node 2 clients/run.py deepspeed tests/hf_suites/trl_trainers.py --trainer sft --stage 3
    torchrun --nproc_per_node 2 clients/run.py ringzero tests/hf_suites/trl_trainers.py --trainer dpo --stage 2
    python -m tests.hf_suites.trl_compare                   (every trainer and stage on both sides, the table)

Nothing here imports deepspeed: each trainer hands `deepspeed=` to accelerate, which builds the engine
(`deepspeed.initialize`) and drives it; under ringzero's runner that `deepspeed` is ringzero's. The model is
a tiny Llama built from a config with a fixed seed (LlamaForCausalLM; LlamaForSequenceClassification for
the reward trainer), the tokenizer a word-level one built in code, the data sentences drawn from a seeded
generator: nothing is downloaded. LoRA (peft) on q_proj and v_proj, r=4 (`--full`: every weight); fp32 (TRL's configs default to
bf16: set off), no gradient checkpointing (TRL's default is on; `--checkpointing` turns it on), AdamW
with torch's implementation and weight decay 0, constant learning rate, `--steps` optimizer steps of 2
sequences per rank, then `trainer.evaluate()` on 8 held-out rows and `trainer.save_model()` (the LoRA
adapter, or the model with `--full`; at ZeRO-3 gathered by stage3_gather_16bit_weights_on_model_save). SFT and DPO score tokens
through TRL's fused LM head (trl/trainer/utils.py::add_fused_lm_head), which at ZeRO-3 reads and gathers
`lm_head.weight` itself. Rank 0 prints `STEP i LOSS x` per step, `EVAL_LOSS x`, and the folder it saved.
Cost: a few seconds of training; most of the time is importing transformers, datasets and TRL.
"""
from __future__ import annotations

import argparse
import os
import random

import torch

WORDS = ("the a one two red blue cat dog bird fish runs sits eats sees big small old new here there and then "
         "good bad yes no up down left right sun moon tree rock hill lake").split()
SEQ_WORDS = 10


def tokenizer():
    """A word-level tokenizer over WORDS (pad 0, eos 1, unk 2), built in code: no hub download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sentences(n: int, seed: int, words: int = SEQ_WORDS) -> list[str]:
    g = random.Random(seed)
    return [" ".join(g.choice(WORDS) for _ in range(words)) for _ in range(n)]


def dataset(kind: str, n: int, seed: int):
    """SFT: {"text"}; DPO: {"prompt", "chosen", "rejected"}; reward: {"chosen", "rejected"} (implicit prompt)."""
    from datasets import Dataset
    if kind == "sft":
        return Dataset.from_dict({"text": sentences(n, seed)})
    prompts, a, b = sentences(n, seed, 4), sentences(n, seed + 1, 6), sentences(n, seed + 2, 6)
    if kind == "dpo":
        return Dataset.from_dict({"prompt": prompts, "chosen": a, "rejected": b})
    return Dataset.from_dict({"chosen": [p + " " + c for p, c in zip(prompts, a)],
                              "rejected": [p + " " + r for p, r in zip(prompts, b)]})


def model(kind: str, tok, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=False, num_labels=1)
    torch.manual_seed(seed)      # the same weights on every rank and both engines
    return (LlamaForSequenceClassification if kind == "reward" else LlamaForCausalLM)(cfg)


def ds_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:   # save_model gathers the adapter through the engine (16-bit here means the model's dtype: fp32)
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer", choices=("sft", "dpo", "reward"), default="sft")
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (TRL's default)")
    ap.add_argument("--full", action="store_true", help="train every weight (no LoRA; DPO then builds a reference "
                    "model of its own, a second deepspeed.initialize)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="runs/trl_trainers")
    ap.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    import trl
    from peft import LoraConfig
    tok = tokenizer()
    net = model(a.trainer, tok, a.seed)
    common = dict(output_dir=a.output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                  max_steps=a.steps, learning_rate=a.lr, weight_decay=0.0, lr_scheduler_type="constant",
                  warmup_steps=0, logging_steps=1, report_to=[], save_strategy="no", eval_strategy="no",
                  use_cpu=True, seed=a.seed, data_seed=a.seed, bf16=False, fp16=False,
                  gradient_checkpointing=a.checkpointing, deepspeed=ds_config(a.stage))
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="SEQ_CLS" if a.trainer == "reward" else "CAUSAL_LM") if not a.full else None
    train, held = dataset(a.trainer, 32, a.seed), dataset(a.trainer, 8, a.seed + 100)
    if a.trainer == "sft":
        trainer = trl.SFTTrainer(model=net, args=trl.SFTConfig(max_length=16, **common), train_dataset=train,
                                 eval_dataset=held, processing_class=tok, peft_config=lora)
    elif a.trainer == "dpo":
        ref = model(a.trainer, tok, a.seed) if a.full else None   # a model built in code has no path TRL could load
        trainer = trl.DPOTrainer(model=net, ref_model=ref, args=trl.DPOConfig(max_length=16, **common),
                                 train_dataset=train, eval_dataset=held, processing_class=tok, peft_config=lora)
    else:
        trainer = trl.RewardTrainer(model=net, args=trl.RewardConfig(max_length=16, **common), train_dataset=train,
                                    eval_dataset=held, processing_class=tok, peft_config=lora)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(a.output_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        for e in trainer.state.log_history:
            if "loss" in e:
                print(f"STEP {e['step']} LOSS {e['loss']!r}")
        print(f"EVAL_LOSS {metrics['eval_loss']!r}")
        print(f"SAVED {a.output_dir}")


if __name__ == "__main__":
    main()
