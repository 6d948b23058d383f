"""How far our ZeRO may sit from DeepSpeed's, and the step-by-step verdict.

    python -m parity.zero.ds_parity --stage 2 --world-size 2 --steps 5     (prints render()'s table)

Tolerance.for_run gives the bounds (the reasoning below); compare() checks two runs' per-step
loss, gradient norm, LR and max |Δparam|, and the final parameters; render() draws the rich table.
Cost: O(Ψ) per compared parameter set, no processes.

Why the two sides are NOT bit-identical in fp32, and why the drift stays at rounding level:
  * pre-division: DeepSpeed divides gradients by N before the reduction (exact for N = 2, a
    power of two; one rounding per element otherwise); a reducer may divide after summing.
  * reduction order: (a+b)+c ≠ a+(b+c) in floating point; a ring reduce-scatter adds the N
    contributions in a different order for each chunk than gloo's all-reduce or a tree does.
    For N = 2 addition is commutative and exact-order-free, so this source vanishes.
  * per-owner reduce vs reduce-scatter: DeepSpeed ZeRO-1/2 buckets gradients and reduces each
    bucket (or reduce-scatters it); a flat reduce-scatter groups elements differently — same
    sums, different order for N > 2.
  * the gradient norm: sum of squares over per-parameter norms (DeepSpeed, in fp64) vs over a
    flat shard then across ranks (ours): a different summation order, ~1e-7 relative — provided
    the sums are accumulated carefully: torch.linalg.vector_norm in fp32 over an 11.7 M-element
    CPU tensor loses ~5e-4 (tutorials/08_parity.md). The clip coefficient
    max_norm / (norm + 1e-6) inherits the norm's error, and so does every clipped update.
  * fused vs torch Adam: "torch_adam": true makes DeepSpeed use torch.optim.AdamW (no JIT build);
    a hand-written Adam on a flat shard may order lr·m̂/(√v̂ + ε) differently (1 ulp per step).
Adam's update lr·m̂/(√v̂+ε) has size ≲ lr and is insensitive to the gradient's scale, so a relative
gradient perturbation δ moves each parameter by ≲ lr·δ per step: after S steps |Δp| ≲ S·lr·δ
with δ ≈ 1e-6 — far below the effect of any real bug (a missing weight-decay group moves p by
lr·wd·|p| per step; a wrong averaging factor changes the gradient norm by ×N).
bf16 rounds every parameter and activation to 8 mantissa bits (relative 2^-8 ≈ 3.9e-3): one
flipped rounding of the bf16 copy of a parameter is 2^-8·|p|, hence the looser bf16 tolerances.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from rich.table import Table


@dataclass
class Tolerance:
    """How far ours may sit from DeepSpeed. See the module docstring for the reasoning."""
    loss_rtol: float
    norm_rtol: float
    param_atol: float

    def __post_init__(self):
        for k, v in asdict(self).items():
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"Tolerance.{k} must be a positive finite number, got {v!r}")

    @classmethod
    def for_run(cls, bf16: bool, steps: int, lr: float) -> "Tolerance":
        if not bf16:
            # Loss and norm: sums of ≤ 1e5 fp32 terms in another order, relative error ≲ 1e-6; we
            # measured ≤ 1.3e-7 (ours vs DeepSpeed, and DeepSpeed's own stages against each other,
            # N = 2 and 3). Parameters: where |g| ≲ ε = 1e-8 (cancellation noise, e.g. embedding
            # rows) Adam moves p by lr·g/ε, so an absolute gradient difference Δg of one ulp of the
            # partial sums (~1e-12) becomes ~lr·1e-4 per step. Measured after 5 steps at lr 1e-2 on
            # tiny DistilBERT: DeepSpeed ZeRO-1 vs its own ZeRO-3 1.0e-6, ours vs DeepSpeed ZeRO-3
            # 2.5e-6 (= 5e-5·S·lr). Allowed: S·lr·4e-4, 8× the worst seen. A dropped weight-decay
            # group moves p by lr·wd·|p| = 1e-3·|p| per step: 5× the bound at |p| = 0.02 (embedding
            # init), 50× at |p| = 0.2.
            return cls(loss_rtol=1e-5, norm_rtol=1e-5, param_atol=max(1e-6, steps * lr * 4e-4))
        # bf16: 8 mantissa bits (relative 2^-8 ≈ 3.9e-3) in the forward, in the gradients (DeepSpeed
        # reduces them in bf16) and in the bf16 copy of every parameter. Measured between DeepSpeed's
        # own stages: loss 1e-3, norm 2.2e-3 relative, parameters 2^-7 (one bf16 ulp at |p| ∈ [1, 2)).
        # Allowed: 10× on loss and norm; two bf16 ulps at |p| < 2 plus 10% of the summed LR for steps
        # where tiny-v̂ elements flip sign. bf16 cannot see a weight-decay bug; the fp32 runs do.
        return cls(loss_rtol=1e-2, norm_rtol=2e-2, param_atol=2 ** -6 + 0.1 * steps * lr)


@dataclass
class ParityResult:
    rows: list[dict]
    max_param_diff: float
    worst_param: str
    tol: Tolerance
    ok: bool
    failures: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)


def compare(ref: dict, ours: dict, tol: Tolerance) -> ParityResult:
    """Step-by-step comparison of two train_one() results (rank 0's)."""
    rows, failures = [], []
    for a, b in zip(ref["records"], ours["records"], strict=True):
        dl = abs(a["loss"] - b["loss"])
        dn = abs(a["grad_norm"] - b["grad_norm"])
        ok_l = dl <= tol.loss_rtol * max(abs(a["loss"]), 1e-12)
        ok_n = dn <= tol.norm_rtol * max(abs(a["grad_norm"]), 1e-12)
        ok_lr = math.isclose(a["lr"], b["lr"], rel_tol=1e-6, abs_tol=1e-12)
        dp = b.get("max_dparam")  # present in lockstep runs; the final-step bound holds at every step
        ok_p = dp is None or dp <= tol.param_atol
        rows.append({**{f"{k}_ref": a[k] for k in ("loss", "grad_norm", "lr")},
                     **{f"{k}_ours": b[k] for k in ("loss", "grad_norm", "lr")},
                     "step": a["step"], "dloss": dl, "dnorm": dn, "max_dparam": dp,
                     "ok": ok_l and ok_n and ok_lr and ok_p})
        for good, what, x, y in ((ok_l, "loss", a["loss"], b["loss"]), (ok_n, "grad norm", a["grad_norm"], b["grad_norm"]),
                                 (ok_lr, "lr", a["lr"], b["lr"])):
            if not good:
                failures.append(f"step {a['step']}: {what} {x:.8g} (reference) vs {y:.8g} (ours)")
        if not ok_p:
            failures.append(f"step {a['step']}: max |Δparam| {dp:.3g} > {tol.param_atol:.3g}")
    pa, pb = ref["params"], ours["params"]
    if set(pa) != set(pb):
        failures.append(f"parameter names differ: only in reference {sorted(set(pa) - set(pb))}, "
                        f"only in ours {sorted(set(pb) - set(pa))}")
    worst, worst_name = 0.0, ""
    for n in sorted(set(pa) & set(pb)):
        if pa[n].shape != pb[n].shape:
            failures.append(f"{n}: shape {tuple(pa[n].shape)} vs {tuple(pb[n].shape)}")
            continue
        d = (pa[n] - pb[n]).abs().max().item() if pa[n].numel() else 0.0
        if not d <= worst:  # also catches NaN
            worst, worst_name = d, n
    if not worst <= tol.param_atol:
        failures.append(f"final parameters: max |Δ| = {worst:.3g} in {worst_name} > {tol.param_atol:.3g}")
    return ParityResult(rows, worst, worst_name, tol, not failures, failures)


def render(result: ParityResult, title: str):
    """A rich table: one row per optimizer step, then the verdict."""
    t = Table(title=title)
    per_step = all(r.get("max_dparam") is not None for r in result.rows)
    for col in ("step", "lr", "loss (DeepSpeed)", "loss (ours)", "|Δloss|", "grad norm (DeepSpeed)",
                "grad norm (ours)", "|Δnorm|") + (("max |Δparam|",) if per_step else ()) + ("ok",):
        t.add_column(col, justify="right")
    for r in result.rows:
        t.add_row(str(r["step"]), f"{r['lr_ref']:.3g}", f"{r['loss_ref']:.7f}", f"{r['loss_ours']:.7f}",
                  f"{r['dloss']:.2e}", f"{r['grad_norm_ref']:.7f}", f"{r['grad_norm_ours']:.7f}", f"{r['dnorm']:.2e}",
                  *((f"{r['max_dparam']:.2e}",) if per_step else ()), "[green]yes[/]" if r["ok"] else "[red]NO[/]")
    return t
