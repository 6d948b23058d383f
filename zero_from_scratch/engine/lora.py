"""LoRA under ZeRO: peft adapters on a frozen model, which linears to target, a clear error when
they do not exist.

    deepspeed --num_gpus 2 classification/train.py --lora 8            (also --engine zero | ddp)
    python -m recipes.lora --model distilbert --r 8 --world-size 2      (memory per stage, full vs LoRA)

LoRA (Hu et al., arXiv 2106.09685) freezes a d_out×d_in weight W and trains B·A (d_out×r, r×d_in)
added to it. Trainable elements per adapted linear: r·(d_in + d_out) instead of d_in·d_out, so the
optimizer's model states (grads + fp32 master + Adam m, v) shrink from (b + K)·Ψ to (b + K)·Ψ_lora
while the frozen weights still cost b·Ψ (b·Ψ/N at ZeRO-3, where they are partitioned too: frozen.py).
No communication of its own: the engine reduces only the adapters' gradients (2(N-1)/N·b·Ψ_lora).
"""
from __future__ import annotations

import torch.nn as nn

from zero_from_scratch.engine.models import tiny_distilbert

# the attention and FFN linears of the architectures the recipes use (peft's own names)
TARGETS = {"distilbert": ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"],
           "bert": ["query", "key", "value", "dense"],
           "t5": ["q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}


class LoraError(ValueError):
    """LoRA cannot be applied as asked (unknown architecture, missing target modules)."""


def linear_names(model: nn.Module) -> set[str]:
    """The last name component of every Linear-like module (nn.Linear, GPT-2's Conv1D)."""
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            out.add(name.rsplit(".", 1)[-1])
    return out


def default_targets(model: nn.Module) -> list[str]:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in TARGETS:
        raise LoraError(f"no default LoRA target modules for model type {kind!r} (known: {sorted(TARGETS)}); "
                        f"pass targets= from its linears: {sorted(linear_names(model))}")
    have = linear_names(model)
    return [t for t in TARGETS[kind] if t in have]


def apply_lora(model: nn.Module, r: int, targets: list[str] | None = None, alpha: float | None = None,
               task_type: str | None = "SEQ_CLS", rank: int = 0):
    """peft.get_peft_model(model, LoraConfig(r, targets)); the task head stays trainable (SEQ_CLS:
    peft's modules_to_save). Raises LoraError naming the rank, the missing targets and what exists."""
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"rank {rank}: LoRA rank r must be a positive int, got {r!r}")
    targets = list(targets) if targets else default_targets(model)
    have = linear_names(model)
    missing = [t for t in targets if t not in have]
    if missing or not targets:
        raise LoraError(f"rank {rank}: LoRA target modules {missing or targets} do not exist in "
                        f"{type(model).__name__}; its linear modules are {sorted(have)}")
    from peft import LoraConfig, get_peft_model   # optional dependency: the `recipes` extra
    cfg = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, lora_dropout=0.0,
                     target_modules=targets, task_type=task_type)
    return get_peft_model(model, cfg)


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable Ψ, frozen Ψ), each shared parameter once."""
    t = f = 0
    for _, p in model.named_parameters():
        if p.requires_grad:
            t += p.numel()
        else:
            f += p.numel()
    return t, f


def tiny_lora_distilbert(r: int = 4) -> nn.Module:
    """The parity model: ds_parity's tiny DistilBERT (dim 32, 2 layers, dropout 0) + LoRA r=4."""
    m = apply_lora(tiny_distilbert(), r)
    for n, p in m.named_parameters():          # B starts at zero in peft; give it a value so A's
        if "lora_B" in n:                      # gradient is not zero at step 1 (a stronger test)
            nn.init.normal_(p, std=0.02)
    return m
