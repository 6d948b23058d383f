"""The figure scripts draw from real data and stamp what they drew with where it came from.
The cheap ones run here (into a temporary folder); the measured ones run under `make figures`."""
import json

import pytest

pytest.importorskip("matplotlib")

from figures import common  # noqa: E402


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
