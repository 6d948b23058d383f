"""Model-state memory and communication accounting, next to the formulas.

    python -m zero_from_scratch.engine.report --model distilbert --world-size 2

Memory per rank (ZeRO paper, arXiv 1910.02054; b = bytes per param element, 2 mixed / 4 fp32):
                params     grads      fp32 master          Adam m+v
  stage 0       bΨ         bΨ         4Ψ (mixed only)      8Ψ
  stage 1       bΨ         bΨ         4Ψ/N                 8Ψ/N
  stage 2       bΨ         bΨ/N       4Ψ/N                 8Ψ/N
  stage 3       bΨ/N       bΨ/N       4Ψ/N                 8Ψ/N
Mixed: 2+2+K with K = 12 (master + m + v), i.e. 16Ψ → 2Ψ + 2Ψ + 12Ψ/N → 2Ψ + 14Ψ/N → 16Ψ/N.
fp32: the flat parameter buffer is the master, so K = 8. The engine measures its actual tensors;
they equal the formula with Ψ replaced by the padded count P (each unit padded to a multiple
of N: at most N-1 extra elements per unit). DeepSpeed's estimator says 2Ψ + 18Ψ/N for ZeRO-2
(and ZeRO-1) because it keeps a 2-byte gradient partition *and* an fp32 copy of it (2 + 4 + 12);
ZeRO-3: 4·largest_layer + 18Ψ/N.

Communication per optimizer step and rank, ring algorithms (b·P bytes of payload):
  stage 0  all-reduce 2(N-1)/N · bP
  stage 1  reduce-scatter (N-1)/N · bP + all-gather (N-1)/N · bP              = 2(N-1)/N · bP
  stage 2  as stage 1 (reduce-scatter once per micro-batch)
  stage 3  all-gather fwd + all-gather bwd + reduce-scatter, per micro-batch = 3(N-1)/N · bP
plus one 8-byte all-reduce for the global gradient norm (and, stage 3, the tiny int64
divergence checks), listed separately.
ZeRO++ at stage 3 (arXiv 2306.10209; per unit, s = P/N, m nodes × k ranks; rows named by purpose):
  qwZ  each param all-gather sends (N-1)·w8(s), w8(s) = s + 4⌈s/4096⌉ (int8 + fp32 scales):
       ¼ of fp32's (N-1)·4s, ½ of bf16's (qwz.py)
  hpZ  the backward all-gather runs inside a group of k ranks (a node): (k-1)·P/k elements,
       nothing across nodes; with qwZ it moves the int8 bytes, (k-1)·(N/k)·w8(s) (hpz.py)
  qgZ  the reduce-scatter becomes int4 all-to-alls: (k-1)·w4(m·s) inside the node, then
       (m-1)·w4(s) across, w4(x) = ⌈x/2⌉ + 4⌈x/64⌉; one node: (N-1)·w4(s) ≈ 0.14 of fp32's (qgz.py)
  qwZ + qgZ in fp32: (N-1)·(2·w8(s) + w4(s)) ≈ 0.21 × ZeRO-3's 3·(N-1)·4s per micro-batch
  (bf16: ≈ 0.43 × 3·(N-1)·2s).
"""
from __future__ import annotations

from fractions import Fraction

from primitives.engine.cost import ring_fraction   # the one ring byte formula
from zero_from_scratch.engine.comm import expert_comms
from rich.table import Table
from primitives.log import print0


def model_state_bytes(stage: int, psi: int, n: int, mixed: bool) -> dict:
    """The paper's per-rank bytes (exact fractions) for Ψ elements."""
    b = 2 if mixed else 4
    sh = Fraction(psi, n)
    return {"params": b * (sh if stage >= 3 else psi),
            "grads": b * (sh if stage >= 2 else psi),
            "master": (4 * (sh if stage >= 1 else psi)) if mixed else 0,
            "optimizer": 8 * (sh if stage >= 1 else psi)}


def deepspeed_estimate(stage: int, psi: int, n: int, largest_layer: int = 0):
    """deepspeed's estimate_zero{2,3}_model_states_mem_needs (no offload); None for stage 0."""
    if stage in (1, 2):
        return 2 * psi + int(18 * psi / n)
    if stage == 3:
        return 4 * largest_layer + int(18 * psi / n)
    return None


def comm_bytes_per_step(stage: int, unit_padded: list, n: int, b: int, gas: int = 1) -> dict:
    """Ring bytes one rank sends per optimizer step, per collective purpose (layout's padded units)."""
    if n == 1:
        return {}
    P = sum(unit_padded)
    f = lambda k: int(k * ring_fraction("reduce_scatter", n) * b * P)  # noqa: E731  (k × (N-1)/N·S)
    if stage == 0:
        return {"grad all-reduce": f(2)}
    if stage in (1, 2):
        return {"grad reduce-scatter": f(1) * (gas if stage == 2 else 1), "param all-gather": f(1)}
    return {"param all-gather (forward)": f(1) * gas, "param all-gather (backward)": f(1) * gas,
            "grad reduce-scatter": f(1) * gas}


def paper_comm(stage: int, psi: int, n: int, b: int) -> Fraction:
    return (3 if stage == 3 else 2) * ring_fraction("all_gather", n) * psi * b


def _fmt(x) -> str:
    if x is None:
        return "—"
    return f"{float(x) / 2**20:,.3f} MiB" if x >= 2**20 else f"{float(x):,.0f} B"


def memory_report(engine, print_table: bool = True) -> dict:
    lay, n = engine.layout, engine.comm.size
    nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    measured = dict(engine.stage.memory())
    measured["master"] = nb(engine.master) if engine.mixed else 0
    measured["optimizer"] = sum(nb([s[k] for k in engine.optimizer.STATE]) for s in engine.optimizer.state)
    frozen = engine.frozen.report() if hasattr(engine, "frozen") else None
    if frozen and frozen["frozen_partitioned"]:
        measured["params"] -= frozen["frozen_bytes"]   # stage 3 keeps the frozen shards next to the trainable ones
    stage = engine.stage_id
    formula = model_state_bytes(stage, lay.numel, n, engine.mixed)
    padded = model_state_bytes(stage, lay.padded, n, engine.mixed)   # stage 0 pads nothing (P = Ψ)
    largest = max((u.numel for u in lay.units), default=0)
    rep = {"stage": stage, "world_size": n, "psi": lay.numel, "padded_psi": lay.padded,
           "dtype": str(engine.dtype).replace("torch.", ""), "measured": measured,
           "formula": {k: float(v) for k, v in formula.items()},
           "formula_at_padded": {k: float(v) for k, v in padded.items()},
           "total_measured": sum(measured.values()), "total_formula": float(sum(formula.values())),
           "deepspeed_estimate": deepspeed_estimate(stage, lay.numel, n, largest), "frozen": frozen,
           "offload": engine.offload.report() if hasattr(getattr(engine, "offload", None), "report") else None,
           "offload_param": engine.stage.poff.report() if getattr(engine.stage, "poff", None) else None,
           "offload_grads": engine.stage.goff.report() if getattr(engine.stage, "goff", None) else None}
    if print_table and engine.comm.rank == 0:

        t = Table(title=f"ZeRO-{stage} model-state memory per rank (Ψ={lay.numel:,}, padded {lay.padded:,}, "
                        f"N={n}, {rep['dtype']})")
        for c in ("", "measured", "formula", "formula at padded Ψ"):
            t.add_column(c, justify="right")
        for k in measured:
            t.add_row(k, _fmt(measured[k]), _fmt(formula[k]), _fmt(padded[k]))
        t.add_row("total", _fmt(rep["total_measured"]), _fmt(rep["total_formula"]),
                  _fmt(sum(padded.values())))
        t.add_row("DeepSpeed estimator", "", _fmt(rep["deepspeed_estimate"]), "")
        if frozen and frozen["frozen_psi"]:   # LoRA & co: weights only, no grads/master/Adam
            fb = (2 if engine.mixed else 4) * Fraction(frozen["frozen_psi"], n if stage == 3 else 1)
            t.add_row(f"frozen params (Ψ_frozen={frozen['frozen_psi']:,}; trainable Ψ={lay.numel:,})",
                      _fmt(frozen["frozen_bytes"]), _fmt(fb), "")
        print0(t)
    return rep


def comm_report(engine, print_table: bool = True) -> dict:
    c, lay = engine.comm, engine.layout
    usage = c.last_step or c.usage
    b = 2 if engine.mixed else 4
    rows = [{"purpose": k, "collective": u.collective, "calls": u.calls, "payload": u.payload,
             "ring_formula": u.formula, "sent": u.sent} for k, u in usage.items()]
    for name, ec in expert_comms(engine).items():     # MoE expert-data-parallel groups: this rank's one
        rows += [{"purpose": f"{k} [{name}, {ec.size} ranks]", "collective": u.collective, "calls": u.calls,
                  "payload": u.payload, "ring_formula": u.formula, "sent": u.sent}
                 for k, u in (ec.last_step if c.last_step else ec.usage).items()]
    data = [r for r in rows if r["purpose"] not in ("grad-norm all-reduce", "divergence check",
                                                             "monitor loss all-reduce")]
    rep = {"stage": engine.stage_id, "world_size": c.size, "impl": c.impl, "rows": rows,
           "data_sent": sum(r["sent"] or 0 for r in data) if c.impl == "primitives" else None,
           "data_formula": sum(r["ring_formula"] for r in data),
           "paper": float(paper_comm(engine.stage_id, lay.numel, c.size, b)),
           "paper_at_padded": float(paper_comm(engine.stage_id, lay.padded, c.size, b))}
    rep["overlap"] = overlap_rows(c.last_events if c.last_step else c.events)
    if engine.stage_id == 3:
        rep["stage3"] = dict(engine.stage.stats)
    if print_table and c.rank == 0:

        if rep["overlap"]:
            print0(overlap_table(rep["overlap"], engine.stage_id))
        t = Table(title=f"ZeRO-{engine.stage_id} bytes sent per optimizer step by rank 0 (N={c.size}, {c.impl})")
        for col in ("purpose", "collective", "calls", "payload S", "ring formula", "measured"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(r["purpose"], r["collective"], str(r["calls"]), _fmt(r["payload"]), _fmt(r["ring_formula"]),
                      _fmt(r["sent"]))
        k = 3 if engine.stage_id == 3 else 2
        t.add_row("data total", "", "", "", _fmt(rep["data_formula"]), _fmt(rep["data_sent"]))
        t.add_row(f"paper {k}(N-1)/N·Ψ", "", "", "", _fmt(rep["paper"]), "")
        print0(t)
    return rep


def overlap_rows(events) -> list[dict]:
    """One row per asynchronous collective of the step (overlap_comm), times in ms since step start."""
    ms = lambda x: round(1e3 * x, 3)  # noqa: E731
    return [{"purpose": e.purpose, "what": e.what, "bytes": e.nbytes, "launched_ms": ms(e.launched),
             "started_ms": ms(e.started), "finished_ms": ms(e.finished), "waited_ms": ms(e.waited),
             "exposed_ms": ms(e.exposed), "hidden_ms": ms(max(0.0, min(e.finished, e.waited) - e.started))}
            for e in events]


def overlap_table(rows, stage: int):
    """What overlapped: a collective ran from `started` to `finished` on the communication thread;
    the caller asked for it at `waited` and blocked `exposed` ms. Hidden = the part of its run that
    happened before anyone waited, i.e. while backward (or the previous module) computed."""
    t = Table(title=f"ZeRO-{stage} overlapped collectives, last step, rank 0 (ms since the step began)")
    for col in ("purpose", "bucket / module", "size", "launched", "started", "finished", "waited", "exposed wait",
                "hidden"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["purpose"], r["what"], _fmt(r["bytes"]), *(f"{r[k]:.1f}" for k in (
            "launched_ms", "started_ms", "finished_ms", "waited_ms", "exposed_ms", "hidden_ms")))
    comm = sum(r["finished_ms"] - r["started_ms"] for r in rows)
    t.add_row("total", "", "", "", "", "", "", f"{sum(r['exposed_ms'] for r in rows):.1f}",
              f"{sum(r['hidden_ms'] for r in rows):.1f} of {comm:.1f}")
    return t
