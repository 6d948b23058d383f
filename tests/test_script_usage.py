"""What a learner sees when a runnable script is misused: a usage error at parsing, and one line
per rank naming the valid range; and every script's --help, by path and by -m.

    python -m pytest -q tests/test_script_usage.py

Cost: two short torchrun runs, and one forked interpreter per script for --help (tests/warm_python.py).
"""
import json
import os
import re
import sys

import pytest

from conftest import ROOT, run_cmd
from tests import upstream


def test_unknown_algorithm_is_refused_at_parsing():
    r = run_cmd("python primitives/allreduce.py --algorithms ring,nonsense", check=False)
    assert r.returncode == 2
    assert "'nonsense' is not a all_reduce algorithm" in r.stderr and "rabenseifner" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_root_one_line_per_rank_with_the_range():
    from primitives.launch import free_port
    r = run_cmd(f"torchrun --standalone --nproc_per_node 2 --master_port {free_port()} primitives/run.py scatter --root 5",
                check=False, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "--root 5 is out of range" in ln]
    # torchrun stops the other rank as soon as one exits, so one or both lines appear; each whole
    assert lines and all(ln.count("out of range") == 1 for ln in lines), lines
    assert all(ln.startswith(("rank 0: ", "rank 1: ")) and ln.endswith("expected 0 ≤ root ≤ 1") for ln in lines), lines



# --help of every script with a command line, by path and by -m (tests/warm_python.py forks one warm
# interpreter per script, with the sys.path either form gives it)
NO_COMMAND_LINE = {   # run as their docstrings show, no arguments read (checked below)
    "benchmarks/textbook.py",
    "ddp_examples/01_single_process.py", "ddp_examples/02_naive.py", "ddp_examples/03_flat.py",
    "ddp_examples/04_bucketed.py", "ddp_examples/05_torch_ddp.py",
    "figures/ch02_ring.py", "figures/ch03_overlap.py", "figures/ch04_zero_memory.py",
    "figures/ch05_zero3_timeline.py", "figures/ch10_tensor_parallel.py",
    "pipeline_parallel/engine/model.py", "pipeline_parallel/engine/simulator.py", "pipeline_parallel/models/llama.py",
    "seq2seq/grammar.py", "zero_from_scratch/engine/wall_clock.py",
}
UPSTREAM = {   # DeepSpeedExamples' files as upstream wrote them, copied for the diff (clients/README.md)
    "clients/cifar10/upstream.py", "clients/hello_deepspeed/upstream.py", "clients/pipeline/upstream.py",
}
PATH_ONLY = {"clients/pipeline/train.py"}   # imports its sibling alexnet.py, as upstream's does
READS_ARGV = re.compile(r"argparse|sys\.argv|parse_args|add_launch_args|import fire|fire\.Fire|def main\(argv")


# the scripts under tests/ that a README shows a reader
READER_TOOLS = ("tests/ds_unit/harness.py", "tests/ds_bulk/run.py", "tests/ds_bulk/table.py",
                "tests/hf_suites/trl_compare.py", "tests/hf_suites/trl_trainers.py", "tests/hf_suites/fused_head.py",
                "tests/hf_suites/run.py", "tests/hf_suites/table.py", "tests/hf_suites/hub_standins.py")


def scripts() -> list[str]:
    """Every file a reader can run: a __main__ guard or a package's __main__.py (tests' own helpers aside)."""
    out = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__")) and x not in ("runs", "build"))
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), ROOT)
            if not f.endswith(".py") or (rel.startswith("tests" + os.sep) and rel not in READER_TOOLS):
                continue
            with open(os.path.join(ROOT, rel)) as fh:
                if f == "__main__.py" or '__name__ == "__main__"' in fh.read():
                    out.append(rel)
    return sorted(out)


def shown() -> str:
    """Every Markdown file of the repository (README.md, RESULTS.md, the tutorials, each package's
    README): where a reader is shown how to run a script."""
    docs = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith((".", "__")) and x not in ("runs", "build")]
        docs += [os.path.join(d, f) for f in files if f.endswith(".md")]
    return "\n".join(open(p).read() for p in sorted(docs))


def help_targets() -> list[str]:
    """Every script answers --help by path; by -m too where a Markdown file shows it either way
    or its own docstring shows `-m MODULE`."""
    text, targets = shown(), []
    for rel in scripts():
        if rel in NO_COMMAND_LINE or rel in UPSTREAM:
            continue
        mod = rel[:-3].replace(os.sep, ".")
        if rel.endswith("__main__.py"):
            targets.append("module:" + mod.rsplit(".", 1)[0])
            continue
        with open(os.path.join(ROOT, rel)) as f:
            src = f.read()
        own = src.split('"""')[1] if src.startswith('"""') else ""      # the module docstring
        by_module = re.search(rf"-m {re.escape(mod)}\b", own) is not None
        targets.append("path:" + rel)
        if by_module or (rel not in PATH_ONLY and (rel in text or re.search(rf"-m {re.escape(mod)}\b", text))):
            targets.append("module:" + mod)
    return targets


def test_scripts_without_a_command_line_read_no_arguments():
    copied = {f["path"] for f in upstream.manifest()["files"] + upstream.manifest()["patched"]}
    for rel in sorted(NO_COMMAND_LINE | UPSTREAM | PATH_ONLY):
        assert rel in copied or os.path.exists(os.path.join(ROOT, rel)), f"{rel} is gone: drop it from this test's lists"
    for rel in sorted(NO_COMMAND_LINE):
        with open(os.path.join(ROOT, rel)) as f:
            hit = READS_ARGV.search(f.read())
        assert not hit, f"{rel} reads its command line ({hit.group(0)!r}): take it out of NO_COMMAND_LINE"


@pytest.fixture(scope="module")
def helps():
    r = run_cmd(f"{sys.executable} tests/warm_python.py --help-of {' '.join(help_targets())}", timeout=600, env={"COLUMNS": "120"})
    found = [json.loads(ln.split(" ", 1)[1]) for ln in r.stdout.splitlines() if ln.startswith("warm-result ")]
    return {d["target"]: d for d in found}


@pytest.mark.parametrize("target", help_targets())
def test_help(target, helps):
    d = helps[target]
    shown = f"python {target[5:]}" if target.startswith("path:") else f"python -m {target[7:]}"
    assert d["rc"] == 0 and re.search(r"usage|synopsis", d["out"], re.I), f"`{shown} --help` exited {d['rc']}:\n{d['out']}"
