"""One host at memory speed: six goals for all-reduce on one host, measured in one run, met or not.

    python -m benchmarks.one_host                  # N = 2 and 4, 4 KiB–64 MiB, median of 5 (~7 min)
    python -m benchmarks.one_host --quick          # smoke run: N = 2, two sizes, 3 reps (~15 s; 45 s at load 29)
    python -m benchmarks.one_host --json out.json --write-model cost_model.json   (RINGZERO_COST_MODEL)
    python -m benchmarks.one_host --from out.json  # re-fit and re-print a saved run, measuring nothing

For each N it launches benchmarks/one_host_worker.py once: under mpiexec when mpi4py and mpiexec
are installed (one job holds MPICH's world and gloo's, so MPICH's built-in is interleaved with
the rest; MPIR_CVAR_ENABLE_HEAVY_YIELD=1, or MPICH busy-polls the shared cores), under torchrun
otherwise (no MPICH column). Each size times, in turn, `--reps` times: the default path
(P.all_reduce: check on, transport auto, algorithm auto), the same unchecked, gloo's and MPICH's
built-in, a memcpy of the same bytes on every rank, and every all-reduce algorithm unchecked on
the shm and the tcp transport; the table shows medians (busbw as nccl-tests: S/t·2(N-1)/N). The
check's cost is timed call by call, the default call with the check on and off in turn (a median
of single calls: the load's descheduled calls drop out of it). The default path's prediction adds a
check term κ per N, the median of that measured cost (checked − unchecked seconds) up to 64 KiB,
where a call's µs are not drowned by its bytes (the check's work does not grow with S).
The cost model's α, β, γ, o are then fitted to those per-algorithm times (cost_fit.py, per family
and N), its error printed per size, and `auto`'s pick checked against the measured best.
Buffers are float32 zeros. RINGZERO_TRANSPORT is cleared for the run (the default is measured).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from rich.table import Table

from figures.common import ROOT
from benchmarks.collectives import parse_size, sizes_between
from primitives.engine.cost import choose, family, params, predict
from benchmarks.cost_fit import as_python, fit_table, write_model
from primitives.launch import free_port
from primitives.log import console

GOALS = [  # key, statement
    ("gloo", "default busbw ≥ 4× gloo's built-in at every size, 4 KiB–64 MiB"),
    ("mpich", "default busbw ≥ 1.5× MPICH's built-in at every size from 1 MiB"),
    ("memcpy", "64 MiB default busbw ≥ 0.6 of a memcpy's bandwidth"),
    ("check", "the check costs ≤ 10 % of an unchecked call at every size"),
    ("model", "α-β prediction within 30 % of the measured busbw at every size (default path)"),
    ("auto", "auto within 10 % of the measured best algorithm at every size (default transport)"),
]


def launcher() -> str:
    try:
        import mpi4py  # noqa: F401  (probe only: the MPICH column needs it)
    except ImportError:
        return "torchrun"
    return "mpiexec" if shutil.which("mpiexec", path=_path()) else "torchrun"


def _path() -> str:
    return os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def run_worker(n: int, sizes, reps: int, budget: float, how: str, out: str, ops: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RINGZERO_TRANSPORT"}
    env.update(OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PATH=_path(),
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    head = (["mpiexec", "-n", str(n)] if how == "mpiexec" else
            ["torchrun", "--standalone", f"--nproc_per_node={n}", f"--master_port={free_port()}"])
    cmd = head + ["-m" if how == "torchrun" else sys.executable, *([] if how == "torchrun" else ["-m"]),
                  "benchmarks.one_host_worker", "--launcher", how, "--sizes", ",".join(map(str, sizes)),
                  "--reps", str(reps), "--budget", str(budget), "--ops", ops, "--json", out]
    console.print(f"[dim]{' '.join(cmd)}[/]")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def index(results: list[dict]) -> tuple[dict, list]:
    """(all-reduce rows by (n, size, name), the fit's points from every op), medians in seconds."""
    out, pts = {}, []
    for res in results:
        for r in res["rows"]:
            r.setdefault("op", "all_reduce")
            r.update(med=statistics.median(r["samples"]), lo=min(r["samples"]), hi=max(r["samples"]))
            if r["op"] == "all_reduce":
                out[(r["n"], r["size"], r["name"])] = r
            if r["transport"]:
                pts.append((r["transport"], r["op"], r["algo"], r["n"], r["size"], r["med"]))
    return out, pts


def busbw(n, S, t):
    return S / t * 2 * (n - 1) / n / 1e9


def analyse(rows: dict, table: dict, default_tp: str) -> dict:
    """Per (n, size): the cells every goal reads."""
    cells, kappa = {}, {}
    for (n, S, name), r in sorted(rows.items()):  # the check term: one constant per N, the median of its
        if name == "checked_alt" and (S <= 64 << 10 or n not in kappa):  # cost where µs resolve (≤ 64 KiB)
            kappa.setdefault(n, []).append(r["med"] - rows[(n, S, "unchecked_alt")]["med"])
    kappa = {n: max(0.0, statistics.median(v)) for n, v in kappa.items()}
    for (n, S, name), r in rows.items():
        if name != "default":
            continue
        get = lambda k: rows.get((n, S, k))  # noqa: E731
        bus = busbw(n, S, r["med"])
        c = dict(bus=bus, algo=r["algo"], gloo=bus / busbw(n, S, get("gloo")["med"]), kappa=kappa.get(n),
                 memcpy=bus / (S / get("memcpy")["med"] / 1e9),
                 check=get("checked_alt")["med"] / get("unchecked_alt")["med"] - 1 if get("checked_alt") else None)
        if get("mpich"):
            c["mpich"] = bus / busbw(n, S, get("mpich")["med"])
        for key, row, k in (("model", r, kappa.get(n, 0.0)), ("model_unchecked", get("unchecked"), 0.0)):
            p = table.get(family(row["algo"], default_tp), {}).get(n)     # busbw error: t / t_pred - 1
            c[key] = row["med"] / (predict("all_reduce", row["algo"], n, S, p) + k) - 1 if p else None
        for tp in ("shm", "tcp"):
            algos = {k.split("/")[1]: v["med"] for (m, s, k), v in rows.items() if m == n and s == S and k.startswith(tp + "/")}
            pick, refit = choose("all_reduce", n, S, "gloo", tp), _refit_choice(table, tp, n, S, algos)
            best = min(algos, key=algos.get)
            c[tp] = dict(pick=pick, best=best, loss=algos[pick] / algos[best] - 1, refit=refit)
        cells[(n, S)] = c
    return cells


def _refit_choice(table, tp, n, S, algos):
    """What auto would pick with this run's fit instead of cost.py's table."""
    def t(al):
        p = table.get(family(al, tp), {}).get(n)
        return predict("all_reduce", al, n, S, p) if p else float("inf")
    return min(algos, key=t)


def goals(cells: dict, has_mpich: bool) -> list[tuple[str, str, list[str]]]:
    """(statement, met / not met / not measured, the cells where we lose)."""
    def lose(key, bad, fmt, where=lambda n, S: True):
        return [f"N={n} {S >> 10:,} KiB: {fmt(c)}" for (n, S), c in sorted(cells.items())
                if where(n, S) and c.get(key) is not None and bad(c)]
    out = {
        "gloo": lose("gloo", lambda c: c["gloo"] < 4, lambda c: f"{c['gloo']:.2f}×"),
        "mpich": lose("mpich", lambda c: c["mpich"] < 1.5, lambda c: f"{c['mpich']:.2f}×", lambda n, S: S >= 1 << 20),
        "memcpy": lose("memcpy", lambda c: c["memcpy"] < 0.6, lambda c: f"{c['memcpy']:.2f}",
                       lambda n, S: S == max(s for _, s in cells)),
        "check": lose("check", lambda c: c["check"] > 0.10, lambda c: f"{c['check'] * 100:+.0f} %"),
        "model": lose("model", lambda c: abs(c["model"]) > 0.30, lambda c: f"{c['model'] * 100:+.0f} % ({c['algo']})"),
        "auto": lose("shm", lambda c: c["shm"]["loss"] > 0.10,
                     lambda c: f"{c['shm']['pick']} vs {c['shm']['best']} +{c['shm']['loss'] * 100:.0f} %"),
    }
    return [(text, "not measured" if key == "mpich" and not has_mpich else ("met" if not out[key] else "not met"),
             out[key]) for key, text in GOALS]


def print_tables(rows, pts, cells, table, info):
    ns = sorted({n for n, _ in cells})
    for n in ns:
        t = Table(title=f"all_reduce, N = {n}, float32: busbw GB/s, median of the reps (transport {info['transport']})")
        for c in ("size", "default → algo", "unchecked", "gloo", "mpich", "memcpy GB/s", "×gloo", "×mpich",
                  "/memcpy", "check cost", "model err", "unchecked → algo, model err"):
            t.add_column(c, justify="right")
        for (m, S), c in sorted(cells.items()):
            if m != n:
                continue
            bb = lambda k: f"{busbw(n, S, rows[(n, S, k)]['med']):.3f}" if (n, S, k) in rows else "–"  # noqa: E731
            t.add_row(f"{S:,}", f"{c['bus']:.3f} → {c['algo']}", bb("unchecked"), bb("gloo"), bb("mpich"),
                      f"{S / rows[(n, S, 'memcpy')]['med'] / 1e9:.2f}", f"{c['gloo']:.2f}×",
                      f"{c['mpich']:.2f}×" if "mpich" in c else "–", f"{c['memcpy']:.2f}",
                      _pct(c["check"]), _pct(c["model"]),
                      f"{rows[(n, S, 'unchecked')]['algo']}, {_pct(c['model_unchecked'])}")
        console.print(t)
        k = next((c["kappa"] for (m, _), c in cells.items() if m == n and c["kappa"] is not None), None)
        if k is not None:
            console.print(f"model err of the default path: the algorithm's prediction + the check term κ = {k * 1e6:.1f} µs")
    t = Table(title="cost model fitted to this run (cost_fit.py: relative least squares, constants ≥ 0)")
    for c in ("family", "N", "α µs", "β ns/B", "γ ns/B", "o µs", "points", "worst error", "median |error|"):
        t.add_column(c, justify="right")
    errs = fit_errors(pts, table)
    for fam, per_n in table.items():
        for n, p in per_n.items():
            e = [v for (f, m, _, _), v in errs.items() if f == fam and m == n]
            worst = max(e, key=abs)
            t.add_row(fam, str(n), f"{p.alpha * 1e6:.1f}", f"{p.beta * 1e9:.3f}", f"{p.gamma * 1e9:.3f}",
                      f"{p.o * 1e6:.1f}", str(len(e)), f"{worst * 100:+.0f} %", f"{statistics.median(map(abs, e)) * 100:.0f} %")
    console.print(t)
    for n in ns:
        names = sorted({(f, a) for (f, m, a, _) in errs if m == n and not a.startswith("ag:")})
        t = Table(title=f"fit error per size, N = {n}: predicted / measured time − 1, per family/algorithm "
                        "(all-reduce; all-gathers: the fit table's points)")
        t.add_column("size", justify="right")
        for f, a in names:
            t.add_column(f"{f}/{a}", justify="right")
        for S in sorted({s for (m, s) in cells if m == n}):
            t.add_row(f"{S:,}", *[f"{errs[(f, n, a, S)] * 100:+.0f}" for f, a in names])
        console.print(t)
    for tp in ("shm", "tcp"):
        t = Table(title=f"auto on the {tp} transport: its pick (cost.py's table) vs the measured best")
        for c in ("N", "size", "auto's pick", "measured best", "loss", "pick with this run's fit"):
            t.add_column(c, justify="right")
        for (n, S), c in sorted(cells.items()):
            a = c[tp]
            loss = "" if a["pick"] == a["best"] else (f"[red]+{a['loss'] * 100:.0f} %[/]" if a["loss"] > 0.1
                                                      else f"+{a['loss'] * 100:.0f} %")
            t.add_row(str(n), f"{S:,}", a["pick"], a["best"], loss, a["refit"])
        console.print(t)


def _pct(x) -> str:
    return "–" if x is None else f"{x * 100:+.0f} %"


def fit_errors(pts, table) -> dict:
    """(family, N, algo, S) -> predicted / measured - 1 (time); all-gathers' algo as "ag:<algo>"."""
    out = {}
    for tp, c, a, n, s, t in pts:
        fam = family(a, tp)
        out[(fam, n, ("ag:" if c != "all_reduce" else "") + a, s)] = predict(c, a, n, s, table[fam][n]) / t - 1
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.03, help="seconds per sample")
    ap.add_argument("--launcher", choices=("auto", "mpiexec", "torchrun"), default="auto")
    ap.add_argument("--ops", default="all_reduce,all_gather_single", help="all_reduce, plus all-gathers for the fit")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = 2, 4 KiB and 1 MiB, 3 reps, all-reduce only")
    ap.add_argument("--json", help="write the rows, the fit and the goals here")
    ap.add_argument("--from", dest="source", help="a saved --json run: fit and print it again (auto's picks: "
                    "the cost model as loaded now)")
    ap.add_argument("--write-model", help="write the fitted table as the JSON RINGZERO_COST_MODEL reads")
    a = ap.parse_args(argv)
    ranks, sizes = [int(x) for x in a.ranks.split(",")], sizes_between(parse_size(a.min_bytes), parse_size(a.max_bytes))
    if a.quick:
        ranks, sizes, a.reps, a.budget, a.ops = [2], [4 << 10, 1 << 20], 3, 0.002, "all_reduce"
    how = launcher() if a.launcher == "auto" else a.launcher
    if a.source:
        with open(a.source) as f:
            saved = json.load(f)
        results, how = [dict(info=saved["info"], rows=saved["rows"])], saved["info"].get("launcher", how)
        a.reps = len(saved["rows"][0]["samples"])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            results = [run_worker(n, sizes, a.reps, a.budget, how, os.path.join(tmp, f"n{n}.json"), a.ops) for n in ranks]
    info = dict(results[0]["info"], launcher=how)
    console.print(f"[bold]one host[/]: {info['cores']} cores, load {info['load']:.1f} at the start, torch {info['torch']}, "
                  f"{info['mpich'] or 'no MPICH (torchrun launch)'}, MPIR_CVAR_ENABLE_HEAVY_YIELD={info['heavy_yield']}, "
                  f"launcher {how}, median of {a.reps} interleaved reps, cost model "
                  f"{os.environ.get('RINGZERO_COST_MODEL') or 'cost.FITTED'}")
    rows, pts = index(results)
    table = fit_table(pts)
    cells = analyse(rows, table, info["transport"])
    print_tables(rows, pts, cells, table, info)
    verdict = goals(cells, info["mpich"] is not None)
    t = Table(title="the goals: one host at memory speed")
    for c in ("goal", "verdict", "cells where we lose"):
        t.add_column(c)
    for text, v, losing in verdict:
        t.add_row(text, {"met": "[green]met[/]", "not met": "[red]not met[/]"}.get(v, v), "; ".join(losing))
    console.print(t)
    console.print("cost.FITTED from this run:\n" + as_python(table))
    if a.write_model:
        write_model(table, a.write_model, info)
        console.print(f"wrote {a.write_model}: RINGZERO_COST_MODEL={a.write_model} makes auto use it")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(info=info, rows=[{k: r[k] for k in ("op", "n", "size", "name", "transport", "algo", "samples", "iters")}
                                             for res in results for r in res["rows"]],
                           fit={fam: {n: p.__dict__ for n, p in d.items()} for fam, d in table.items()},
                           goals=verdict), f, indent=1)
    return verdict


if __name__ == "__main__":
    main()
