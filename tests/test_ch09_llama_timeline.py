"""The llama timeline picture (figures/ch09_llama_timeline.py) draws what the engine ran: on each rank
the recorded forward/backward order is the textbook 1F1B schedule's, every micro-batch once each way.

    python -m pytest -q -m slow tests/test_ch09_llama_timeline.py        (one 2-rank spawn, ~1-3 min on 2 cores)
"""
import pytest

pytest.importorskip("matplotlib")

from figures import common  # noqa: E402
from figures import ch09_llama_timeline as fig  # noqa: E402
from pipeline_parallel.schedules import build  # noqa: E402


@pytest.mark.slow
def test_llama_timeline_is_the_1f1b_schedule_and_is_stamped(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "IMG", str(tmp_path))
    m = 4
    (path,) = fig.main(["--shapes", "2x1", "--steps", "1", "--micro-batches", str(m)])
    assert common.read_meta(path)["Source"] == "figures.ch09_llama_timeline"
    from primitives.launch import spawn   # the engine run the picture drew, again, to read its events
    out = spawn(fig._run, 2, args=(2, "tiny", m, 2, 16, 1), timeout=600)
    for events, stage, dp, names in out:
        ran = [(k, mb) for k, mb, *_ in events if k in ("fwd", "bwd")]
        want = [(op.kind, op.mb) for op in build("1f1b", stage, 2, m) if op.kind in ("fwd", "bwd")]
        assert ran == want, (stage, ran, want)
        assert dp == 0 and names == ("embed … block 1" if stage == 0 else "block 2 … head")
