"""Every command README.md shows runs, at a small size, and prints what the README says it prints.

    python -m pytest -q tests/test_readme_commands.py

The README's first block is `make demo` and `make test`: the Makefile's recipes are checked to be
the commands the README says they run, and the demo's command runs here at a small size (the suite
itself is not run from inside itself). Every other command line of every ```bash block runs as shown,
from the repository root, with the small-size flags of SMALL appended (the scripts' own flags: fewer
steps, rows and bytes; argparse keeps the last value of a repeated flag); its output must contain
the line EXPECT names. A README command with no entry here fails: a new command needs its size.
Cost: one run per command, 2 to 4 ranks each, seconds to a minute each on 2 cores.
"""
import os
import re
import shlex

import pytest

from conftest import ROOT, have_mpi, run_cmd
from primitives.launch import free_port

README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
DEMO = "deepspeed --num_gpus 2 classification/train.py"

# script (path) or module (-m) -> (flags for a small run, a line its output must contain)
SMALL = {
    "benchmarks.textbook": ("", r"textbook vs engine"),
    "primitives/allreduce.py": ("--size 4096 --iters 1", r"│ ring +│ ring +│ pass"),
    "benchmarks/collectives.py": ("--sizes 4096 --iters 2 --warmup 1 --reps 1", r"cost model vs measured"),
    # DistilBERT's 66,955,010 parameters; ZeRO-3 fp32 at N=4: 16Ψ/4 bytes = 255.4 MiB, comm 3·3/4·4Ψ = 574.7 MiB
    "zero_from_scratch.engine.report": ("", r"(?s)(?=.*66,955,010)(?=.*ZeRO-3)(?=.*255\.4)(?=.*574\.7).*paper 2 or 3"),
    "planner": ("", r"(?s)tp.*layouts predicted in [\d.]+ s"),      # llama-70b on 512 H100s, with its time
    "pipeline_parallel/train.py": ("--steps 1", r"(?s)step 0: loss \d.*held-out loss"),
    "classification/parallel/train.py": ("--steps 1 --batch 4 --eval-samples 0", r"(?s)mesh dp=2 × pp=1 × tp=2.*step +0 +loss \d"),
    "classification/train.py": ("--max-steps 1 --max-train-samples 64 --max-eval-samples 8 --epochs 1 "
                                "--output-dir {tmp}/run --tensorboard {tmp}/tb", r"test split, best checkpoint"),
    "seq2seq/train.py": ("--steps 2 --train-size 64 --test-size 16 --output-dir {tmp}/run", r"held-out exact match"),
    "zero_from_scratch.as_deepspeed": ("", r"deepspeed names served by ringzero"),
    "recipes/hf_trainer.py": ("--steps 2 --output-dir {tmp}/out", r"HELD-OUT ACCURACY \d"),
}


def blocks() -> list[tuple[str, str]]:
    with open(README) as f:
        return FENCE.findall(f.read())


def commands() -> list[str]:
    """Every command line of every bash block, its trailing comment dropped."""
    out = []
    for lang, body in blocks():
        assert lang == "bash", f"README.md has a ```{lang} block; every block is a command a reader runs"
        out += [ln.split("  #")[0].strip() for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return out


def key(cmd: str) -> str:
    """What a command runs: its last script path, else the module after -m."""
    words = shlex.split(cmd)
    paths = [w for w in words if w.endswith(".py")]
    if paths:
        return paths[-1]
    return words[words.index("-m") + 1]


def small(cmd: str, tmp) -> tuple[str, str]:
    k = key(cmd)
    assert k in SMALL, f"README.md shows `{cmd}`: give {k} its small-size flags and expected line in SMALL"
    flags, expect = SMALL[k]
    if cmd.startswith("deepspeed "):     # the launcher's default port may be taken by another run on this host
        cmd = cmd.replace("deepspeed ", f"deepspeed --master_port {free_port()} ", 1)
    return f"{cmd} {flags.format(tmp=tmp)}".strip(), expect


def makefile_recipe(target: str) -> list[str]:
    with open(os.path.join(ROOT, "Makefile")) as f:
        m = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", f.read(), re.M)
    assert m, f"the Makefile has no `{target}` target"
    return [ln.strip() for ln in m.group(1).splitlines()]


def test_first_block_is_make_demo_and_make_test():
    assert commands()[:2] == ["make demo", "make test"] and blocks()[0][1].split() == ["make", "demo", "make", "test"]


def test_make_test_runs_the_suite():
    assert makefile_recipe("test") == ["$(PY) -m pytest -q -n 2 --dist loadgroup"]
    with open(README) as f:
        assert "`make test` runs `python -m pytest -q -n 2 --dist loadgroup`" in " ".join(f.read().split())


def test_every_make_target_named_exists():
    """`make test-slow`, `make figures` ...: every make target the README names is a Makefile target."""
    with open(README) as f:
        named = set(re.findall(r"`make (?:PYTHON=\S+ )?([\w-]+)`", f.read()))
    assert named >= {"demo", "test"}, named
    for target in sorted(named):
        makefile_recipe(target)


def test_make_demo_is_the_deepspeed_command():
    assert any(ln.endswith(DEMO) for ln in makefile_recipe("demo")), makefile_recipe("demo")
    with open(README) as f:
        assert f"`make demo` runs `{DEMO}`" in " ".join(f.read().split())


def test_every_command_has_a_small_size():
    for cmd in commands():
        if not cmd.startswith("make "):
            small(cmd, "TMP")
    assert {key(c) for c in commands() if not c.startswith("make ")} | {key(DEMO)} == set(SMALL), "SMALL names a command README.md no longer shows"


@pytest.mark.deepspeed
def test_make_demo_runs_small(tmp_path):
    """What the README says the demo prints: the resolved "auto" values, a loss line, the test accuracy."""
    cmd, expect = small(DEMO, tmp_path)
    out = run_cmd(cmd, timeout=600, env={"COLUMNS": "160"}).stdout
    assert "resolved configuration" in out and re.search(r"loss \d", out) and re.search(expect, out), out[-3000:]


@pytest.mark.parametrize("cmd", [c for c in commands() if not c.startswith("make ")])
def test_readme_command(cmd, tmp_path):
    if cmd.startswith("mpiexec") and not have_mpi():
        pytest.skip("mpi4py/mpiexec not installed")
    full, expect = small(cmd, tmp_path)
    r = run_cmd(full, timeout=600, env={"COLUMNS": "160"})
    assert re.search(expect, r.stdout + r.stderr), f"`{full}` did not print /{expect}/:\n{(r.stdout + r.stderr)[-3000:]}"


def test_readme_is_a_front_door():
    with open(README) as f:
        text = f.read()
    assert len(text.encode()) < 8192, f"README.md is {len(text.encode())} bytes; keep it under 8 KB (results: RESULTS.md)"
    prose = FENCE.sub("", text).splitlines()
    long = [f"{i}: {len(ln)} chars" for i, ln in enumerate(prose, 1) if len(ln) > 160]
    assert not long, f"README.md prose lines over 160 characters: {long}"
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads[:3] == ["Two commands", "Map", "One command each"], heads
    assert text.index("ringzero**") < text.index("## Two commands"), "the first paragraph says what ringzero is"
    assert "[READING.md](READING.md)" in text and "[RESULTS.md](RESULTS.md)" in text

