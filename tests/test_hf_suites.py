"""The HF DeepSpeed test files (accelerate's and transformers', copied, not kept) under DeepSpeed and ringzero.

    python -m pytest -q tests/test_hf_suites.py                 (the table's rules and the copies' hashes: < 1 s)
    python -m pytest -q -m slow tests/test_hf_suites.py         (every copied file, both engines; the
                                                                 transformers copy adds 11-16 min per engine at load 10)
    python -m tests.hf_suites.table                             (the table from the last full run)

run.py runs one pytest per (file, engine), offline; ringzero's side has `import deepspeed` served by the
runner's finder. A case that passes under DeepSpeed must pass under ringzero, or fail with ringzero's
one-line refusal (table.py).
"""
import hashlib
import os
import re

import pytest

from tests import upstream
from tests.hf_suites import run, table


def test_the_table_sorts_hub_deepspeed_failures_refusals_and_failures():
    f = "accelerate/tests/deepspeed/t.py"
    ds = {f"{f}::C::a": ["passed", "", False], f"{f}::C::b": ["passed", "", False], f"{f}::C::c": ["passed", "", False],
          f"{f}::C::d": ["failed", "E  OSError: ... offline mode ...", True],
          f"{f}::C::e": ["failed", "ModuleNotFoundError: No module named 'evaluate'", False],
          f"{f}::C::g": ["skipped", "needs fp16", False]}
    rz = {f"{f}::C::a": ["passed", "", False], f"{f}::C::c": ["failed", "E   AssertionError: 1 != 2", False],
          f"{f}::C::b": ["failed", "E   NotServedError: deepspeed.runtime.pipe.schedule is not served by ringzero (...)",
                         False]}
    (r,) = table.rows(ds, rz)
    assert [table.count(r, k) for k in table.COLS] == [6, 1, 2, 3, 1, 1, 1]
    assert dict(r["refused"]) == {"not served: deepspeed.runtime.pipe.schedule": 1}
    assert set(r["ds_other"]) == {"needs a package: evaluate", "skipped: needs fp16"}


def test_a_launched_process_failure_reports_its_cause():
    text = ("E   RuntimeError: 'accelerate launch x' failed with returncode 1\n"
            "E   ModuleNotFoundError: No module named 'evaluate'\n"
            "E   torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nE   =====")
    assert run.last_line(text) == "ModuleNotFoundError: No module named 'evaluate'"
    assert run.last_line("E   assert 1 == 2\nE   AssertionError: boom") == "E   AssertionError: boom"
    launched = ("E   RuntimeError: 'accelerate launch x' failed\nE   [rank0]: ValueError: Type fp16 is not supported\n"
                "E   [rank0]: RuntimeError: world_size (1) is less than sequence_parallel_size 2\nE   =====")
    assert run.last_line(launched) == "RuntimeError: world_size (1) is less than sequence_parallel_size 2"


def _git_blob(path: str) -> str:
    data = open(path, "rb").read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_local_transformers_copy_is_the_listed_text():
    """transformers' files are not in git (UPSTREAM.md): where the local copy is present, each file hashes
    to the blob listed, so the results in the table came from that text."""
    listed = dict(re.findall(r"^\| (transformers/\S+) \| `[0-9a-f]{40}` \| \d+ \| `([0-9a-f]{40})` \|$",
                             open(os.path.join(run.HERE, "UPSTREAM.md")).read(), re.M))
    assert set(run.LOCAL_FILES) <= set(listed) and len(listed) == 10
    present = {f: b for f, b in listed.items() if os.path.exists(os.path.join(run.LOCAL, f))}
    if not present:
        pytest.skip(f"no local copy of transformers' tests under {run.LOCAL} (UPSTREAM.md)")
    changed = [f for f, blob in present.items() if _git_blob(os.path.join(run.LOCAL, f)) != blob]
    assert not changed and len(present) == len(listed), (changed, sorted(set(listed) - set(present)))


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.timeout(7200)
def test_every_case_deepspeed_passes_passes_under_ringzero():
    if not upstream.present("tests/hf_suites/upstream/accelerate/tests/deepspeed/test_deepspeed.py"):
        pytest.skip(upstream.skip_reason("tests/hf_suites/upstream/accelerate"))
    pytest.importorskip("deepspeed")
    pytest.importorskip("parameterized")     # accelerate's tests import it
    rows = []
    files = run.test_files()
    for f in files:     # transformers' file launches 21 one-process trainings per engine: 11-16 min at load 10
        res = {m: run.run_file(f, m, 3600) for m in run.MODES}
        rows += table.rows(*res.values())
    # accelerate's 19; with the local transformers copy, its 19 in-process and 16 launched cases too
    assert sum(r["ds_pass"] for r in rows) >= (54 if set(run.LOCAL_FILES) <= set(files) else 19), rows
    assert not [k for r in rows for k, _ in r["failing"]] and not sum((r["refused"] for r in rows), table.Counter())
