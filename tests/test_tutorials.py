"""Every ```bash and ```python block of every tutorial chapter runs here, in order, from the
repo root with the venv first on PATH. A block that fails fails its chapter's test.
```text blocks are sample output and are not run."""
import os
import re
import sys

import pytest

from conftest import ROOT, run_cmd

TUT = os.path.join(ROOT, "tutorials")
CHAPTERS = sorted(f for f in os.listdir(TUT) if re.match(r"\d\d_.*\.md$", f))
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(path):
    with open(path) as f:
        return [(lang, body) for lang, body in FENCE.findall(f.read()) if lang in ("bash", "python")]


def test_index_lists_every_chapter():
    with open(os.path.join(TUT, "README.md")) as f:
        index = f.read()
    linked = set(re.findall(r"\((\d\d_[^)]+\.md)\)", index))
    assert linked == set(CHAPTERS), f"tutorials/README.md links {sorted(linked)}, chapters are {CHAPTERS}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_runs(chapter, tmp_path):
    found = blocks(os.path.join(TUT, chapter))
    assert found, f"{chapter} has no runnable block"
    for i, (lang, body) in enumerate(found):
        if lang == "bash":
            script = tmp_path / f"block{i}.sh"
            script.write_text("set -euo pipefail\n" + body)
            run_cmd(f"bash {script}", timeout=600)
        else:
            script = tmp_path / f"block{i}.py"
            script.write_text(body)
            run_cmd(f"{sys.executable} {script}", timeout=600)
