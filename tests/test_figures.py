"""The figure scripts draw from real data and stamp what they drew with where it came from.
The cheap ones run here (into a temporary folder); every module runs under the slow test, as
`make figures` runs them, into a temporary folder (RINGZERO_FIGURES_DIR).

    python -m pytest -q tests/test_figures.py                 (~10 s)
    python -m pytest -q -m slow tests/test_figures.py         (python -m figures, ~8 min: ch07 reads
        a short real classification run the test trains first; `make figures` trains the full demo)
"""
import glob
import importlib
import json
import os
import re
import sys

import pytest

pytest.importorskip("matplotlib")

import figures  # noqa: E402
from figures import common  # noqa: E402
from figures.__main__ import modules  # noqa: E402

from conftest import ROOT, run_cmd  # noqa: E402
from primitives.launch import free_port  # noqa: E402


def _embedded() -> set[str]:
    """Every picture a tutorial or the README embeds (img/NAME.png)."""
    names = set()
    for md in glob.glob(os.path.join(ROOT, "tutorials", "*.md")) + [os.path.join(ROOT, "README.md")]:
        with open(md) as f:
            names |= set(re.findall(r"img/([A-Za-z0-9_]+\.png)", f.read()))
    return names


@pytest.fixture
def img_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "IMG", str(tmp_path))
    return tmp_path


def test_png_metadata_round_trip(img_dir):
    plt = common.pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = common.save(fig, "probe", "figures.ch04_zero_memory")
    meta = common.read_meta(path)
    assert meta["Software"] == "ringzero figures" and meta["Source"] == "figures.ch04_zero_memory"
    assert "torch" in meta["Versions"] and "CPU cores" in meta["Machine"]


def test_zero_memory_figures_come_from_the_report(img_dir):
    from figures import ch04_zero_memory
    paths = ch04_zero_memory.main()
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["04_zero_memory_bars.png", "04_zero_ownership.png"]
    assert all(common.read_meta(p)["Source"] == "figures.ch04_zero_memory" for p in paths)


def test_lr_loss_figure_reads_a_runs_jsonl(img_dir, tmp_path):
    from figures import ch07_lr_loss
    log = tmp_path / "metrics.jsonl"
    recs = [dict(event="train", step=s, loss=1.0 / s, lr=[1e-4 * min(1, s / 3)]) for s in range(1, 9)]
    recs += [dict(event="eval", split="val", step=8, accuracy=0.7), dict(event="test", test_accuracy=0.71)]
    log.write_text("\n".join(json.dumps(r) for r in recs))
    (path,) = ch07_lr_loss.main(["--metrics", str(log)])
    assert common.read_meta(path)["Source"] == "figures.ch07_lr_loss"
    log.write_text(json.dumps(dict(event="eval", accuracy=0.5)))
    with pytest.raises(SystemExit, match="no train records"):
        ch07_lr_loss.main(["--metrics", str(log)])


def test_every_embedded_picture_has_a_command_that_redraws_it():
    """Each embedded PNG was drawn by a figures module that exists (its Source stamp), or is in
    figures.ELSEWHERE with the command that draws it."""
    mods = {f"figures.{m}" for m in modules()}
    for png in sorted(_embedded()):
        if png in figures.ELSEWHERE:
            continue
        src = common.read_meta(os.path.join(ROOT, "tutorials", "img", png))["Source"]
        assert src in mods, f"{png} was drawn by {src!r}, which is not a figures module ({sorted(mods)})"
        module = importlib.import_module(src)
        assert hasattr(module, "main"), src


@pytest.mark.slow
def test_make_figures_redraws_every_embedded_picture(tmp_path):
    """`python -m figures` exits 0 and writes every embedded picture a figures module draws.
    Chapter 07 draws a run's own log: a short real run of the default demo (20 steps) stands in
    for the full one (~9 min on an idle 2-core machine)."""
    run = tmp_path / "run"
    run_cmd(f"deepspeed --num_gpus 2 --master_port {free_port()} classification/train.py --output-dir {run} "
            f"--max-steps 20 --max-train-samples 640 --max-eval-samples 64", timeout=900)
    r = run_cmd(f"{sys.executable} -m figures", timeout=1800,
                env={"RINGZERO_FIGURES_DIR": str(tmp_path), "RINGZERO_CLASSIFICATION_RUN": str(run)})
    drawn = {os.path.basename(p) for p in glob.glob(str(tmp_path / "*.png"))}
    want = _embedded() - set(figures.ELSEWHERE)
    assert want <= drawn, f"not redrawn: {sorted(want - drawn)}\n{r.stdout[-3000:]}"
    for png in want:
        meta = common.read_meta(str(tmp_path / png))
        assert meta["Source"].startswith("figures.ch"), (png, meta)
    assert "not drawn here: 11_multinode_busbw.png" in r.stdout, "python -m figures names what it leaves to others"
