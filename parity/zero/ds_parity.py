"""DeepSpeed vs zero_from_scratch, step by step: the command line and the one-call API.

    python -m parity.zero.ds_parity --stage 2 --world-size 2 --steps 5            # MLP, fp32
    python -m parity.zero.ds_parity --stage 3 --model distilbert --bf16 --steps 5
    python -m parity.zero.ds_parity --stage 1 --ours deepspeed                     # harness self-check

make_config() is the DeepSpeed JSON the parity runs use; run_parity / run_parities train both
sides in the same spawned processes (harness.py) and compare them (compare.py, where the
tolerances are reasoned). Cost: one training run per side.
"""
from __future__ import annotations

import argparse
import sys

from zero_from_scratch.engine.models import MODELS
from parity.zero.compare import ParityResult, Tolerance, compare, render
from parity.zero.harness import Job, run_jobs
from parity.zero.sides import SIDES
from primitives.log import console

__all__ = ["make_config", "run_parity", "run_parities", "main"]


def make_config(stage: int, *, bf16: bool = False, micro_bs: int = 4, gas: int = 2, lr: float = 1e-2,
                weight_decay: float = 0.1, clip: float = 0.5, warmup: int = 2, bucket: int = 2000) -> dict:
    """A DeepSpeed JSON config (as a dict) for the parity runs.

    lr and weight decay are large on purpose: a dropped weight-decay group then moves a parameter
    by lr·wd·|p| = 1e-3·|p| per step, 100× the fp32 tolerance. clip 0.5 makes clipping active.
    stage3_param_persistence_threshold 0 partitions even tiny parameters (DeepSpeed keeps
    parameters under 1e5 elements whole by default, which would make ZeRO-3 a no-op here).
    """
    return {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": weight_decay, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": lr / 10, "warmup_max_lr": lr,
                                                     "warmup_num_steps": warmup, "warmup_type": "linear"}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "overlap_comm": False, "contiguous_gradients": True,
                              "stage3_param_persistence_threshold": 0},
    }


def run_parity(model: str, config: dict, steps: int, world_size: int, *, ref_side: str = "deepspeed",
               ours_side: str = "ours", ref_config: dict | None = None, comm_impl: str = "primitives",
               seed: int = 0, tol: Tolerance | None = None, **kw) -> ParityResult:
    """Train both sides (in the same spawned processes, one after the other) and compare."""
    return run_parities([(Job(ref_side, model, ref_config or config, steps),
                          Job(ours_side, model, config, steps, comm_impl))], world_size, seed=seed, tol=tol, **kw)[0]


def run_parities(pairs: list[tuple[Job, Job]], world_size: int, *, seed: int = 0, tol: Tolerance | None = None,
                 **kw) -> list[ParityResult]:
    """Many (reference, ours) pairs in one spawn; a ParityResult per pair."""
    flat = [j for pair in pairs for j in pair]
    res = run_jobs(flat, world_size, seed=seed, **kw)  # lockstep=True adds max |Δparam| per step
    out = []
    for i, (ref_job, ours_job) in enumerate(pairs):
        ref, ours = res[2 * i], res[2 * i + 1]
        t = tol or Tolerance.for_run(bool(ours_job.config.get("bf16", {}).get("enabled", False)), ours_job.steps,
                                     float(ours_job.config["optimizer"]["params"]["lr"]))
        r = compare(ref, ours, t)
        r.timings = {"ref_step_s": ref["step_times"], "ours_step_s": ours["step_times"]}
        out.append(r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="mlp")
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--ours", choices=SIDES, default="ours", help="'deepspeed' checks the harness against itself")
    ap.add_argument("--comm-impl", choices=("primitives", "torch"), default="primitives")
    a = ap.parse_args(argv)
    if a.steps < 1 or not 1 <= a.world_size <= 8:
        ap.error(f"--steps must be ≥ 1 and --world-size in 1..8, got {a.steps}, {a.world_size}")
    cfg = make_config(a.stage, bf16=a.bf16)
    res = run_parity(a.model, cfg, a.steps, a.world_size, ours_side=a.ours, comm_impl=a.comm_impl, lockstep=True)
    console.print(render(res, f"ZeRO-{a.stage} {a.model} N={a.world_size} {'bf16' if a.bf16 else 'fp32'}: "
                              f"DeepSpeed vs {a.ours}"))
    console.print(f"final params max |Δ| = {res.max_param_diff:.3g} ({res.worst_param}); "
                  f"tolerance {res.tol}")
    console.print("[green]PARITY OK[/]" if res.ok else "[red]PARITY FAILED[/]\n" + "\n".join(res.failures))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
