"""Every ```bash and ```python block of every tutorial chapter runs here, in order, from the
repo root with the venv first on PATH. A block that fails fails its chapter's test.

```text blocks are sample output and are not run, but a sample that shows a rich table is
checked against what the chapter's commands really printed: every table title, column heading
and row name in the sample must appear in the real output (numbers may differ; names may not). So a
table that lost a row, renamed a column or changed its title fails the chapter's test.
Every picture a chapter embeds must exist and carry the metadata of the figure script that
drew it (figures/common.py), so a hand-made or orphaned PNG fails too.

A ```python block runs as `python BLOCK.py` would, in a child forked from one interpreter that has
imported torch already (tests/warm_python.py): each block's own imports still run, torch's once.
"""
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cmd_env, run_cmd

TUT = os.path.join(ROOT, "tutorials")
CHAPTERS = sorted(f for f in os.listdir(TUT) if re.match(r"\d\d_.*\.md$", f))
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)
FROM = re.compile(r"from:\s*(\S+)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+\.png)\)")
BOX_ROW, BOX_HEAD = "│", "┃"
RULES = set("┏┓┗┛┡┩┢┪└┘┌┐├┤╭╮╰╯━─═┳┻┼╇╈┯┷ ")


def blocks(path):
    """(lang, info, body) of every fenced block. A ```text block whose info says `from: FILE` shows
    the output of a command the chapter does not run (a long benchmark): it names the file that
    prints it (which must exist) and is not compared."""
    with open(path) as f:
        return FENCE.findall(f.read())


def _pattern(label: str) -> re.Pattern:
    """A label with its numbers generalised: 'step 12' matches 'step 3', 'rank 0' 'rank 1'."""
    parts = [r"\d+(?:[.,]\d+)*" if p.isdigit() else re.escape(p) for p in re.split(r"(\d+)", " ".join(label.split()))]
    return re.compile(r"\s+".join("".join(parts).split(r"\ ")))


def sample_signature(text: str) -> list[str]:
    """Table titles and row names of the rich tables in a sample (empty if it shows none)."""
    lines = text.splitlines()
    if not any(BOX_ROW in ln or BOX_HEAD in ln for ln in lines):
        return []
    out = []
    for ln in lines:
        s = ln.strip()
        if not s or set(s) <= RULES or s.strip(".… ") == "":
            continue
        if s[0] in (BOX_ROW, BOX_HEAD):
            if s[0] == BOX_HEAD:
                out += [c.strip() for c in s.strip(BOX_HEAD).split(BOX_HEAD) if c.strip()]
            else:
                first = s.strip(BOX_ROW).split(BOX_ROW)[0].strip()
                if first and first.strip(".… ") and not re.fullmatch(r"[\d.,:%×x/ +-]+", first):
                    out.append(first)
        elif len(ln) - len(ln.lstrip()) >= 4:   # rich centres a table's title above it
            out.append(s)
    return out


def missing_from(output: str, signature: list[str]) -> list[str]:
    flat = " ".join(output.split())
    return [lab for lab in signature if not _pattern(lab).search(flat)]


def test_signature_catches_a_stale_row():
    sample = ("      bytes per step\n┏━━━━━━┳━━━━━┓\n┃ what ┃ MiB ┃\n┡━━━━━━╇━━━━━┩\n"
              "│ grads │ 1.0 │\n│ divergence check │ 2 │\n└──────┴─────┘\n")
    real = "      bytes per step\n┃ what ┃ MiB ┃\n│ grads │ 3.5 │\n"
    assert sample_signature(sample) == ["bytes per step", "what", "MiB", "grads", "divergence check"]
    assert missing_from(real, sample_signature(sample)) == ["divergence check"]
    assert missing_from(real.replace("grads", "gradients"), ["grads"]) == ["grads"]
    assert missing_from("step 3 of 12", ["step 1 of 2"]) == []


def test_index_lists_every_chapter():
    with open(os.path.join(TUT, "README.md")) as f:
        index = f.read()
    linked = set(re.findall(r"\((\d\d_[^)]+\.md)\)", index))
    assert linked == set(CHAPTERS), f"tutorials/README.md links {sorted(linked)}, chapters are {CHAPTERS}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_pictures_come_from_the_figure_scripts(chapter):
    from figures.common import read_meta
    with open(os.path.join(TUT, chapter)) as f:
        for rel in IMAGE.findall(f.read()):
            path = os.path.normpath(os.path.join(TUT, rel))
            assert os.path.exists(path), f"{chapter} embeds {rel}, which does not exist: run `make figures`"
            meta = read_meta(path)
            src = meta.get("Source", "")
            assert meta.get("Software") == "ringzero figures" and src, \
                f"{chapter}: {rel} was not drawn by a figure script (no ringzero metadata)"
            mod = os.path.join(ROOT, *src.split(".")) + ".py"
            assert os.path.exists(mod), f"{chapter}: {rel} says it was drawn by {src}, which does not exist"


ENV = {"COLUMNS": "160", "PYTHONPATH": ROOT}      # this checkout, whatever else is installed


class Warm:
    """`python FILE` for the python blocks: tests/warm_python.py --serve, started once. A block gets
    TIMEOUT seconds (SIGALRM in its child), and the answer is awaited a minute longer; a request
    that does not get its own answer (an interrupted test, a child that outlived its alarm) leaves
    the server killed, and the next request starts a fresh one."""
    TIMEOUT = 480       # under pytest-timeout's 600 s for a whole chapter

    def __init__(self):
        self.proc, self.sent = None, 0

    def _start(self):
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "warm_python.py"), "--serve"],
                                     cwd=ROOT, env=cmd_env(ENV), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def run(self, path, timeout: int = TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.sent += 1
        res = None
        try:
            self.proc.stdin.write(json.dumps({"target": f"path:{path}", "timeout": timeout, "id": self.sent}) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout + 60
            while res is None and select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("warm-result "):
                    res = json.loads(line.split(" ", 1)[1])
        finally:
            if res is None or res.get("id") != self.sent:
                self.close(kill=True)
        cmd = f"python {path}"
        if res is None or res.get("id") != self.sent:
            raise AssertionError(f"{cmd}: no answer from tests/warm_python.py within {timeout + 60} s")
        if res["rc"] == -signal.SIGALRM:
            raise AssertionError(f"{cmd} did not finish within {timeout} s\n--- output\n{res['out'][-8000:]}")
        if check and res["rc"] != 0:
            raise AssertionError(f"command failed ({res['rc']}): {cmd}\n--- output\n{res['out'][-8000:]}")
        return subprocess.CompletedProcess(cmd, res["rc"], res["out"], "")

    def close(self, kill: bool = False):
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc = None


@pytest.fixture(scope="session")    # one per worker: a module fixture would put every chapter on one worker
def warm():
    w = Warm()
    yield w
    w.close()


def test_a_warm_block_runs_as_python_file_would(warm, tmp_path):
    """What the fork keeps from its parent does not show: a block that forgot an import fails, its
    folder is sys.path[0], it is __main__, its exit code and atexit handlers are the interpreter's."""
    cases = {
        "x = torch.zeros(1)": (1, "NameError: name 'torch' is not defined"),
        "import os, sys\nassert sys.path[0] == os.path.dirname(os.path.abspath(__file__)) and __name__ == '__main__'\n"
        "import atexit\natexit.register(print, 'at exit')\nprint(os.getcwd())": (0, f"{ROOT}\nat exit"),
        "raise SystemExit('refused: --x must be > 0')": (1, "refused: --x must be > 0"),
        "import sys\nsys.exit(3)": (3, ""),
    }
    for i, (body, (rc, out)) in enumerate(cases.items()):
        (tmp_path / f"b{i}.py").write_text(body)
        r = warm.run(tmp_path / f"b{i}.py", timeout=60, check=False)
        assert r.returncode == rc and out in r.stdout, (body, r.returncode, r.stdout)
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(30)")
    with pytest.raises(AssertionError, match="did not finish within 1 s"):
        warm.run(tmp_path / "slow.py", timeout=1)
    assert warm.run(tmp_path / "b1.py", timeout=60).stdout.endswith("at exit\n")     # the next answer is its own


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_runs(chapter, tmp_path, warm):
    found = blocks(os.path.join(TUT, chapter))
    assert any(lang in ("bash", "python") for lang, _, _ in found), f"{chapter} has no runnable block"
    outputs, samples = [], []
    for i, (lang, info, body) in enumerate(found):
        if lang == "bash":
            script = tmp_path / f"block{i}.sh"
            script.write_text("set -euo pipefail\n" + body)
            r = run_cmd(f"bash {script}", timeout=600, env=ENV)
        elif lang == "python":
            script = tmp_path / f"block{i}.py"
            script.write_text(body)
            r = warm.run(script)
        else:
            src = FROM.search(info)
            if lang == "text" and src:
                assert os.path.exists(os.path.join(ROOT, src.group(1))), \
                    f"{chapter}: sample block {i} says it comes from {src.group(1)}, which does not exist"
            elif lang == "text":
                samples.append((i, sample_signature(body)))
            continue
        outputs.append(r.stdout + r.stderr)
    # a sample may show the output of a command run further down the chapter: check against all
    everything = "\n".join(outputs)
    stale = [f"sample output block {i} shows {gone}, which no command of the chapter prints any more"
             for i, sig in samples if (gone := missing_from(everything, sig))]
    assert not stale, f"{chapter}: " + "\n".join(stale)
