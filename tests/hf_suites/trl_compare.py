"""TRL's SFT, DPO and reward trainers (tests/hf_suites/trl_trainers.py) under real DeepSpeed and under ringzero.

    python -m tests.hf_suites.trl_compare                          (every case, ~1 min each on 2 cores)
    python -m tests.hf_suites.trl_compare --case sft-zero3         (one case)
    python -m pytest -q -m slow tests/test_hf_trl.py                (the same cases, asserted)

Each side runs `torchrun --nproc_per_node 2 clients/run.py SIDE tests/hf_suites/trl_trainers.py --trainer T
--stage S` (clients/compare.py's launcher: same start-up seed, OMP_NUM_THREADS=1). Compared: every step's
logged training loss and the eval loss (relative difference), and every tensor of the saved LoRA adapter
(adapter_model.safetensors, or model.safetensors for "-full": max |Δ| over the tensor's max |value|). Tolerance 1e-5 relative everywhere, fp32:
the engines add the ranks' gradients in their own order, so the weights may differ in their last bits
after a step (~1e-7); 1e-5 leaves two orders of magnitude over 4 steps. The first line printed names the
machine and versions. Cost: two 2-rank trainings per case.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

from rich.console import Console
from rich.table import Table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from clients.compare import _launch, versions_line  # noqa: E402  (the repo root on sys.path first when run by path)

SCRIPT = "tests/hf_suites/trl_trainers.py"
# TRL's configs turn gradient checkpointing on by default: "-ckpt" runs that way (at ZeRO-3, where it matters)
# "-full": no LoRA, every weight trained (the fused head's lm_head too; DPO's reference model is a second engine)
CASES = {**{f"{t}-zero{s}": (t, s, "") for t in ("sft", "dpo", "reward") for s in (2, 3)},
         **{f"{t}-zero3-ckpt": (t, 3, "--checkpointing") for t in ("sft", "dpo", "reward")},
         **{f"{t}-zero3-full": (t, 3, "--full") for t in ("sft", "dpo")}}
TOL = 1e-5
SIDES = ("deepspeed", "ringzero")


def run(name: str, side: str, out_dir: str, timeout: float = 900) -> dict:
    trainer, stage, flags = CASES[name]
    out = _launch(side, SCRIPT, f"--trainer {trainer} --stage {stage} --output-dir {out_dir} {flags}", timeout)
    from safetensors.torch import load_file   # the adapter (or the model) as save_model wrote it
    saved = "model.safetensors" if "--full" in flags else "adapter_model.safetensors"
    return {"losses": [float(x) for x in re.findall(r"^STEP \d+ LOSS (\S+)$", out, re.M)],
            "eval": float(re.search(r"^EVAL_LOSS (\S+)$", out, re.M).group(1)),
            "weights": load_file(os.path.join(out_dir, saved))}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def compare(name: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="trl-") as tmp:
        r = {s: run(name, s, os.path.join(tmp, s)) for s in SIDES}
    ds, rz = r["deepspeed"], r["ringzero"]
    w = {k: float((ds["weights"][k] - rz["weights"][k]).abs().max() / ds["weights"][k].abs().max().clamp(min=1e-30))
         for k in ds["weights"] if k in rz["weights"]}
    c = {"runs": r, "steps": len(ds["losses"]), "same_steps": len(ds["losses"]) == len(rz["losses"]),
         "loss_rel": max((_rel(a, b) for a, b in zip(ds["losses"], rz["losses"])), default=float("inf")),
         "eval_rel": _rel(ds["eval"], rz["eval"]), "same_tensors": set(ds["weights"]) == set(rz["weights"]),
         "n_tensors": len(ds["weights"]), "weight_rel": max(w.values(), default=float("inf"))}
    c["within"] = (c["same_steps"] and c["same_tensors"] and c["steps"] > 0
                   and max(c["loss_rel"], c["eval_rel"], c["weight_rel"]) <= TOL)
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=list(CASES), help="a case (repeatable); default: all")
    a = ap.parse_args(argv)
    console = Console(width=170)
    import importlib.metadata
    console.print(versions_line() + ", " + ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("trl", "peft")))
    t = Table(title="TRL trainers (LoRA; -full: every weight), fp32, 2 ranks: real DeepSpeed 0.19.8 vs ringzero's runner")
    for col in ("case", "steps", "DeepSpeed last loss", "max rel Δ loss", "eval loss", "rel Δ eval",
                "saved tensors", "max rel Δ weights", f"within {TOL:g}"):
        t.add_column(col)
    ok = True
    for name in a.case or list(CASES):
        c = compare(name)
        ok &= c["within"]
        ds = c["runs"]["deepspeed"]
        t.add_row(name, str(c["steps"]), f"{ds['losses'][-1]:.8f}", f"{c['loss_rel']:.1e}", f"{ds['eval']:.8f}",
                  f"{c['eval_rel']:.1e}", str(c["n_tensors"]), f"{c['weight_rel']:.1e}", "yes" if c["within"] else "NO")
    console.print(t)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
