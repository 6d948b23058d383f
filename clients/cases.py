"""The cases clients/compare.py runs: each client script, its arguments, how its losses are read, its tolerance.

    python -m clients.compare --case NAME        (NAME: a key of ALL_CASES)

A case is one script run on 2 ranks by both sides (real DeepSpeed, ringzero's runner); `resume` runs it twice.
Cost: none here (data only); each case costs two 2-rank trainings in compare.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    script: str       # relative to the repository root
    args: str         # {tmp} and {tokenizer} are filled in
    dtype: str        # "fp32" or "bf16": picks the tolerance
    losses: str       # "stdout" (cifar10's prints), "tensorboard" (train_bert_ds's scalars), "trainer" or "csv"
    resume: str = ""  # a second run's arguments, same {tmp}, after the first ({exp}: the first run's experiment folder)
    same_curve: bool = False   # the resumed run replays the uninterrupted one's steps (the Trainer skips seen batches)
    config: str = ""  # "csv": {config} = this JSON (a repo path) + csv_monitor into {tmp} + `overrides`
    overrides: str = "{}"   # JSON merged into `config`'s top level
    differs: str = ""       # why the two sides are expected to differ (the row shows it; not a failure)


CASES = {
    "cifar10-fp32-zero2": Case("clients/cifar10/cifar10_deepspeed.py",
                               "--dtype fp32 --stage 2 -e 1 --log-interval 1", "fp32", "stdout"),
    "cifar10-bf16-zero0": Case("clients/cifar10/cifar10_deepspeed.py",
                               "--dtype bf16 --stage 0 -e 1 --log-interval 1", "bf16", "stdout"),
    # the script saves at its end (step 7, DeepSpeed's tag global_step6); the resumed run reloads the engine and
    # restarts its data iterator from the first batch (upstream does not skip seen batches): losses of steps 8-11
    "hello-bf16-zero1-offload-resume": Case(
        "clients/hello_deepspeed/train_bert_ds.py",
        "--checkpoint_dir {tmp}/ckpt --tokenizer {tokenizer} --num_layers 2 --num_heads 2 --ff_dim 128 --h_dim 64 "
        "--max_seq_length 32 --batch_size 4 --num_iterations 7 --log_every 1 --dtype bf16", "bf16", "tensorboard",
        resume="--load_checkpoint_dir {exp} --num_iterations 12 --log_every 1 --dtype bf16"),
    "hello-bf16-zero1-offload": Case(
        "clients/hello_deepspeed/train_bert_ds.py",
        "--checkpoint_dir {tmp}/ckpt --tokenizer {tokenizer} --num_layers 2 --num_heads 2 --ff_dim 128 --h_dim 64 "
        "--max_seq_length 32 --batch_size 4 --num_iterations 7 --log_every 1 --dtype bf16", "bf16", "tensorboard"),
}


# recipes/hf_trainer.py (the Hugging Face Trainer, TrainingArguments(deepspeed=...)): 6 steps saving at step 3, then
# resume_from_checkpoint at step 3; compared: the losses of both runs, the resumed steps 4-6 against the
# uninterrupted ones on each side, and the held-out logits. Run here, not by tests/test_as_deepspeed_clients.py:
# tests/test_hf_trainer.py asserts each part.
_TRAINER = "--stage {s} --steps 6 --output-dir {{tmp}}/out --grad-accum {a}"
TRAINER_CASES = {
    **{f"hf-trainer-fp32-zero{s}": Case("recipes/hf_trainer.py", _TRAINER.format(s=s, a=1) + " --save-every 3",
                                        "fp32", "trainer", resume=_TRAINER.format(s=s, a=1) + " --resume-from "
                                        "{tmp}/out/checkpoint-3", same_curve=True) for s in (1, 2, 3)},
    "hf-trainer-fp32-zero2-accum2": Case("recipes/hf_trainer.py", _TRAINER.format(s=2, a=2), "fp32", "trainer"),
}
# DeepSpeed's pipeline example (clients/pipeline/): AlexNet on pp=2, 4 steps of 4 micro-batches of 2 images.
# Its loss is DeepSpeed's csv_monitor's Train/Samples/train_loss (the script's own print keeps 4 decimals).
# The small config asks for torch_adam (torch's AdamW, weight_decay 0.01 by torch's default); "-fused-adam" puts
# upstream's optimizer section back: DeepSpeed's JIT-built CPU FusedAdam (weight_decay 0), which rounds differently.
_PIPE = "--deepspeed_config {config} -p 2 --steps 4 --backend gloo"
_PIPE_CONFIG = "clients/pipeline/ds_config_small.json"
PIPELINE_CASES = {
    "pipeline-fp32-pp2-clip-stage0": Case("clients/pipeline/train.py", _PIPE, "fp32", "csv", config=_PIPE_CONFIG,
                                          overrides='{"pipeline": {"clip_norm": "stage0"}}'),
    "pipeline-fp32-pp2-clip-stage0-fused-adam": Case(
        "clients/pipeline/train.py", _PIPE, "fp32", "csv", config=_PIPE_CONFIG,
        overrides='{"pipeline": {"clip_norm": "stage0"}, "optimizer": {"type": "Adam", "params": {"lr": 0.001, '
        '"betas": [0.9, 0.999], "eps": 1e-8}}}'),
    # the example's own config: under the runner stage 0's norm is the default (as_deepspeed/quirks.py)
    "pipeline-fp32-pp2": Case("clients/pipeline/train.py", _PIPE, "fp32", "csv", config=_PIPE_CONFIG),
    "pipeline-fp32-pp2-clip-global": Case("clients/pipeline/train.py", _PIPE, "fp32", "csv", config=_PIPE_CONFIG,
                                          overrides='{"pipeline": {"clip_norm": "global"}}', differs=(
        "DeepSpeed scales every stage's gradients by stage 0's norm; pipeline.clip_norm 'global' asks ringzero "
        "for all stages' norm; clipping starts at step 2")),
}
ALL_CASES = {**CASES, **TRAINER_CASES, **PIPELINE_CASES}
LOGIT_TOL = 1e-5   # fp32 held-out logits, absolute: see tests/test_hf_trainer.py


def tolerance(dtype: str, loss: float) -> float:
    if dtype == "fp32":
        return 1e-5 * abs(loss)
    return 2.0 ** (math.floor(math.log2(abs(loss))) - 7)
