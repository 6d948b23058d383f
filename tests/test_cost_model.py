"""The fitted cost model: the fit recovers known constants, the table auto reads (cost.FITTED or
RINGZERO_COST_MODEL), the goals' verdicts, and benchmarks/one_host.py --quick end to end.

    python -m pytest -q -x tests/test_cost_model.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.one_host import GOALS, goals
from primitives.engine import cost
from primitives.engine.algos import ALGORITHMS
from primitives.engine.cost import Params, choose, family, params, predict
from benchmarks.cost_fit import coefficients, fit_table, nnls_relative, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
AR = [a for a in ALGORITHMS["all_reduce"] if a != "hierarchical"]


def synthetic(truth: dict, ns=(2, 4)):
    """Times the model itself predicts from `truth` ({family: Params}), as fit points."""
    pts = []
    for n in ns:
        for tp, algos in (("shm", AR + ["shm"]), ("tcp", AR)):
            for a in algos:
                for S in SIZES:
                    pts.append((tp, "all_reduce", a, n, S, predict("all_reduce", a, n, S, truth[family(a, tp)])))
    return pts


def test_fit_recovers_the_constants_that_made_the_times():
    """Noise-free times from known α, β, γ, o: the fit predicts every point back (to lstsq's
    rounding), and returns the constants themselves where the data can tell them apart: for
    the p2p families at N = 4. At N = 2 no algorithm posts two messages in a round (o has no
    effect); the shm family's all-reduce copies and reduces in fixed proportion (only its per-byte sum counts)."""
    truth = {"shm": Params(3e-5, 2e-10, 1e-10, 1e-5), "tcp": Params(2e-4, 8e-10, 1e-10, 5e-5),
             "shm-native": Params(1e-5, 3e-10, 2e-10, 0.0)}
    pts = synthetic(truth)
    table = fit_table(pts)
    for tp, c, a, n, S, t in pts:
        assert predict(c, a, n, S, table[family(a, tp)][n]) == pytest.approx(t, rel=1e-6), (tp, a, n, S)
    for fam in ("shm", "tcp"):
        assert np.allclose(list(table[fam][4].__dict__.values()), list(truth[fam].__dict__.values()), rtol=1e-6)


def test_predict_is_linear_in_the_constants():
    """The fit's premise: predict() = coefficients · (α, β, γ, o), for every algorithm."""
    p = Params(1.7e-4, 3.1e-10, 0.9e-10, 4.4e-5)
    for a in AR + ["shm"]:
        for n in (2, 3, 4, 8):
            for S in SIZES:
                c = coefficients("all_reduce", a, n, S)
                assert predict("all_reduce", a, n, S, p) == pytest.approx(np.dot(c, list(p.__dict__.values())), rel=1e-12)


def test_nnls_keeps_constants_non_negative_and_beats_clipping():
    """Data an unconstrained fit explains with a negative slope: NNLS returns x ≥ 0 whose
    relative residual is no worse than clipping the unconstrained solution at 0."""
    rng = np.random.default_rng(0)
    X = np.abs(rng.normal(size=(30, 3)))
    t = X @ np.array([1.0, 0.5, 0.0]) + 1e-3 - 0.4 * X[:, 2]
    t = np.maximum(t, 1e-3)
    x = nnls_relative(X, t)
    assert np.all(x >= 0)
    free, *_ = np.linalg.lstsq(X / t[:, None], np.ones_like(t), rcond=None)
    assert free.min() < 0                               # the constraint is active
    res = lambda v: np.sum(((X @ v) - t) ** 2 / t ** 2)  # noqa: E731
    assert res(x) <= res(np.maximum(free, 0)) + 1e-12


def test_auto_reads_the_model_file_and_refuses_a_bad_one(tmp_path, monkeypatch):
    """RINGZERO_COST_MODEL: with copies cheap auto takes "shm"; with messages free and copies
    dear it leaves it; a file that is not a model is an error naming the file."""
    cheap, dear = tmp_path / "cheap.json", tmp_path / "dear.json"
    write_model({"shm": {4: Params(1e-4, 1e-9, 1e-9)}, "shm-native": {4: Params(1e-6, 1e-12, 1e-12)}}, str(cheap), {})
    write_model({"shm": {4: Params(0.0, 0.0, 0.0)}, "shm-native": {4: Params(1.0, 1e-6, 1e-6)}}, str(dear), {})
    monkeypatch.setenv(cost.MODEL_ENV, str(cheap))
    assert choose("all_reduce", 4, 1 << 20, "gloo", "shm") == "shm"
    assert choose("all_reduce", 4, 1 << 20, "gloo", "tcp") != "shm"          # never off the shm transport
    monkeypatch.setenv(cost.MODEL_ENV, str(dear))
    assert choose("all_reduce", 4, 1 << 20, "gloo", "shm") != "shm"
    assert params("shm-native", 2) == Params(1.0, 1e-6, 1e-6)                   # nearest N measured
    assert params("tcp", 4) == cost.FITTED["tcp"][4]                            # families not in the file: FITTED
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    monkeypatch.setenv(cost.MODEL_ENV, str(bad))
    with pytest.raises(ValueError, match="bad.json"):
        choose("all_reduce", 4, 1 << 20, "gloo", "shm")


def test_fitted_table_covers_every_family_and_n_with_non_negative_constants():
    for fam in ("shm", "shm-native", "tcp"):
        assert set(cost.FITTED[fam]) >= {2, 4}
        for p in cost.FITTED[fam].values():
            assert min(p.__dict__.values()) >= 0 and p.alpha > 0


def test_goals_name_every_losing_cell():
    """Verdicts from hand-made cells: one cell loses each goal, and the table says where."""
    ok = dict(bus=1.0, algo="shm", gloo=5.0, mpich=2.0, memcpy=0.7, check=0.05, model=0.1,
              shm=dict(pick="shm", best="shm", loss=0.0))
    cells = {(2, 4096): dict(ok), (2, 1 << 20): dict(ok), (4, 64 << 20): dict(ok)}
    assert [v for _, v, _ in goals(cells, True)] == ["met"] * len(GOALS)
    cells[(2, 4096)].update(gloo=3.0, mpich=0.5, check=0.2, model=-0.4)   # mpich below 1 MiB does not count
    cells[(4, 64 << 20)].update(memcpy=0.5, shm=dict(pick="shm", best="ring", loss=0.25))
    got = {text: (v, losing) for text, v, losing in goals(cells, True)}
    verdicts = {key: got[text] for key, text in GOALS}
    assert verdicts["gloo"] == ("not met", ["N=2 4 KiB: 3.00×"])
    assert verdicts["mpich"] == ("met", [])
    assert verdicts["memcpy"] == ("not met", ["N=4 65,536 KiB: 0.50"])
    assert verdicts["check"] == ("not met", ["N=2 4 KiB: +20 %"])
    assert verdicts["model"] == ("not met", ["N=2 4 KiB: -40 % (shm)"])
    assert verdicts["auto"] == ("not met", ["N=4 65,536 KiB: shm vs ring +25 %"])
    assert goals(cells, False)[1][1] == "not measured"


def test_one_host_quick_runs_every_contender_and_fits(tmp_path):
    """The smoke run: one job at N = 2, both sizes, every contender timed, every family fitted
    with constants ≥ 0, auto's pick in the table equal to cost.choose, six goals with a verdict."""
    out = tmp_path / "q.json"
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "benchmarks.one_host", "--quick", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    names = {row["name"] for row in res["rows"]}
    assert {"default", "unchecked", "gloo", "memcpy", "shm/shm", "shm/ring", "tcp/ring", "tcp/one_shot"} <= names
    for row in res["rows"]:
        assert len(row["samples"]) == 3 and min(row["samples"]) > 0
    assert set(res["fit"]) == {"shm", "shm-native", "tcp"}
    for per_n in res["fit"].values():
        assert min(per_n["2"].values()) >= 0
    assert [g[0] for g in res["goals"]] == [text for _, text in GOALS]
    assert all(g[1] in ("met", "not met", "not measured") for g in res["goals"])
    assert "auto on the shm transport" in r.stdout and "fit error per size" in r.stdout
