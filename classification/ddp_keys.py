"""What `--engine ddp` does with every key DeepSpeed 0.19.8's config parser accepts.

    deepspeed --num_gpus 2 classification/train.py --engine ddp      (gate() runs at start-up)

The ddp engine (engines.py::_DDP) is DeepSpeed's semantics by hand around ddp_examples'
BucketedDataParallel: fp32, torch's Adam/AdamW, WarmupLR/WarmupDecayLR, global-norm clipping,
gradient accumulation. It reads the same JSON as the ZeRO engines, so every other key is refused
(it would change the numbers: precision, the gradient reduction, another optimizer or schedule)
or warned (it would change what is printed, saved or how memory is used), saying what DeepSpeed
and --engine zero would do. The table is the ZeRO engine's (zero_keys.KEY_STATUS) re-read for
ddp, so a key DeepSpeed adds is covered in both at once. Cost: a dict walk at start-up.
"""
from __future__ import annotations

from zero_from_scratch.engine.key_status import H, R, W, gate
from zero_from_scratch.engine.zero_keys import KEY_STATUS as ZERO_STATUS

HONOURED = {
    "train_batch_size": "micro × gradient_accumulation × N, as DeepSpeed checks",
    "train_micro_batch_size_per_gpu": "the loader's batch per rank",
    "gradient_accumulation_steps": "no_sync() until the last micro-batch, loss ÷ steps",
    "gradient_clipping": "global-norm clipping after the all-reduce (default 1.0, as DeepSpeed)",
    "optimizer": "Adam/AdamW only (torch's), see its keys", "optimizer.type": "Adam or AdamW; others refused",
    "optimizer.params": "lr, betas, eps, weight_decay, adam_w_mode; torch_adam (same maths)",
    "scheduler": "WarmupLR / WarmupDecayLR only (classification/config.py::lr_at)",
    "scheduler.type": "WarmupLR or WarmupDecayLR; others refused",
    "scheduler.params": "warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps",
    "fp16": "only enabled: false (ddp trains in fp32)", "bf16": "only enabled: false (ddp trains in fp32)",
    "bfloat16": "only enabled: false (ddp trains in fp32)",
}
# keys that would change the gradients or the update if they acted: refused rather than warned
MATHS = ("prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "communication_data_type",
         "amp", "torch_autocast")


def _status(key: str, zero: str) -> str:
    if key in HONOURED or key.startswith(("fp16.", "bf16.", "bfloat16.")):
        return H + HONOURED.get(key, "only enabled: false")
    if key.startswith(("optimizer.", "scheduler.")):
        return H + "read where it applies to Adam/AdamW or WarmupLR/WarmupDecayLR (engines.py::_DDP)"
    if key in MATHS:
        return R + "the ddp engine averages fp32 gradients after one all-reduce; DeepSpeed: " + zero.split(": ", 1)[-1]
    if key == "zero_optimization":
        return W + "the ddp engine is data parallelism without ZeRO (DeepSpeed's stage 0); --engine zero shards"
    if zero.startswith((R, W)):
        return zero
    return W + "not used by the ddp engine; --engine zero: " + zero.split(": ", 1)[-1]


KEY_STATUS = {k: _status(k, v) for k, v in ZERO_STATUS.items() if not k.startswith("zero_optimization.")}
KEY_STATUS["zero_optimization"] = _status("zero_optimization", "")


def check(cfg: dict) -> None:
    """Refuse what the ddp engine cannot do, warn once for what it ignores (at start-up, every rank)."""
    gate(cfg, KEY_STATUS, where="--engine ddp")
    opt, sch = cfg.get("optimizer") or {}, cfg.get("scheduler") or {}
    if str(opt.get("type", "AdamW")).lower() not in ("adam", "adamw"):
        raise ValueError(f"config key 'optimizer.type' = {opt.get('type')!r} is refused: --engine ddp builds torch's "
                         "Adam/AdamW only; --engine zero builds the others")
    if sch and sch.get("type") not in ("WarmupLR", "WarmupDecayLR"):
        raise ValueError(f"config key 'scheduler.type' = {sch.get('type')!r} is refused: --engine ddp follows "
                         "WarmupLR/WarmupDecayLR only; --engine zero builds the others")
    params = opt.get("params") or {}
    if params.get("bias_correction") is False:
        raise ValueError("config key 'optimizer.params.bias_correction' = False is refused: --engine ddp uses "
                         "torch's bias-corrected Adam; --engine zero honours it")
