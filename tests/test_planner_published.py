"""The planner against published runs: Narayanan et al. Table 1 (TFLOP/s per GPU within 15 %),
Megatron-LM's H100 weak and strong scaling (MFU within 5 points), gdGPT's direction; every miss printed."""
import statistics

import pytest

from planner import published as pub


@pytest.fixture(scope="module")
def nar():
    return pub.narayanan_rows()


@pytest.fixture(scope="module")
def weak():
    return pub.megatron_weak_rows()


def test_published_runs_are_predicted_to_fit(nar, weak):
    """They ran, so their layouts fit: the memory side of the check."""
    for r in nar:
        assert r["gib"] < 80, r
    for r in weak:
        assert r["layout"] != "does not fit", r


def test_published_narayanan_table1(nar):
    rows = nar
    for r in rows:
        print(f"{r['model']:10s} reported {r['reported']:5.1f} predicted {r['predicted']:6.1f} ({r['error']:+.1%}) {r['layout']}"
              + ("" if abs(r["error"]) <= 0.15 else "  MISS"))
    assert abs(rows[0]["error"]) < 0.01                  # the calibration row
    errs = [abs(r["error"]) for r in rows[1:]]
    print(f"median |error| {statistics.median(errs):.1%}")
    assert statistics.median(errs) <= 0.15
    assert all(e <= 0.15 for e in errs), "a Table 1 row misses 15 %"


def test_published_megatron_h100(weak):
    strong = pub.megatron_strong_rows()
    pts = [r["points"] for r in weak[1:]] + [r["points"] for r in strong]
    for r in weak + strong:
        print(f"{r['model']:10s} {r['gpus']:5d} GPUs reported {r['reported_mfu']}% predicted {r['predicted_mfu']:.1f}% "
              f"({r['points']:+.1f}) {r['layout']}" + ("" if abs(r["points"]) <= 5 else "  MISS"))
    print(f"median |points| {statistics.median(abs(p) for p in pts):.1f}")
    assert abs(weak[0]["points"]) < 0.1                  # the calibration row
    assert statistics.median(abs(p) for p in pts) <= 5
    assert sum(abs(p) > 5 for p in pts) <= 1, "more than one row misses 5 points"


def test_published_gdgpt_direction():
    """gdGPT: pipeline beats ZeRO-3 at seq 256. Absolute samples/s and the ZeRO-3 OOM at seq 1024
    are misses (printed): the planner predicts 2-3× gdGPT's rate and a fit."""
    rows = {(r["seq"], r["layout"]): r for r in pub.gdgpt_rows()}
    for r in rows.values():
        print(r)
    assert rows[(256, "pipeline")]["predicted"] > rows[(256, "zero3")]["predicted"]
    if pub.host_hooks():       # ZeRO-3's per-module host work slows only the ZeRO-3 rows
        assert rows[(256, "zero3")]["with_host"] < rows[(256, "zero3")]["predicted"]
        assert rows[(256, "pipeline")]["with_host"] == rows[(256, "pipeline")]["predicted"]


def test_planner_best_is_no_worse_than_the_papers_layout(nar):
    for r in nar:
        assert r["best_step_s"] <= r["paper_step_s"] * (1 + 1e-9)
