"""Every number in README.md and RESULTS.md names the command that prints it, and the counts the
README states are the ones `python -m benchmarks.textbook` computes.

    python -m pytest -q tests/test_results_numbers.py

RESULTS.md: every row of every area table has a command cell whose script (or module, or test file)
exists and whose flags that script defines, a machine from the machine table and a date; its prose
holds no number. README.md: a prose line with a number names a command in backticks. Cost: reads
files, imports nothing heavy; under a second.
"""
import os
import re
import shlex

from benchmarks import textbook as T
from clients.cases import ALL_CASES
from conftest import ROOT

AREAS = ["Collectives", "Data parallel", "ZeRO", "Pipeline", "Tensor parallel", "Offload and Infinity",
         "Clients and conformance", "Reliability", "Planner"]
HEADER = ["measured", "result", "command", "machine", "date"]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*(?:python|torchrun|mpiexec|deepspeed|make) [^`]+`")
# digits that are names, not measurements: versions, ZeRO-2, CIFAR-10, 1F1B, 3D, chapter numbers
NAMES = re.compile(r"Python \d+\.\d+|tutorials? \d+(?:(?:, | and )\d+)*|[\w-]*[A-Za-z][\w]*-\d+\b|\b\d+[A-Za-z]\w*")


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def counts_sentence() -> str:
    """The README's one sentence of counts, as benchmarks/textbook.py computes them now."""
    entries = T.reading_entries()
    book = T.textbook_files(entries)
    textbook = sum(T.lines(p) for p in book)
    engine = sum(T.lines(p) for p in T.production_files() if p not in book)
    return (f"The textbook is {textbook:,} lines in {len(book)} files for {len(entries)} ideas; the engine, "
            f"applications and tools around it are {engine:,} lines (`python -m benchmarks.textbook`).")


def test_readme_counts_are_computed():
    want = counts_sentence()
    readme = " ".join(read("README.md").split())
    assert want in readme, f"README.md's counts are stale; the sentence should read:\n{want}"


def numbers(text: str) -> list[str]:
    text = re.sub(r"`[^`]*`", " ", text)                 # inline code: commands, flags, file names
    text = re.sub(r"\]\([^)]*\)", "]", text)             # link targets
    text = NAMES.sub(" ", text)
    return re.findall(r"(?<![\w.])\d[\d,.]*", text)


def test_numbers_helper():
    assert numbers("ZeRO-2 on CIFAR-10, 1F1B and 3D, Python 3.11, tutorials 07, 10 and 12") == []
    assert numbers("it took 25 min (`make test`)") == ["25"]


def test_every_number_in_the_readme_names_its_command():
    bad = [ln for ln in FENCE.sub("", read("README.md")).splitlines() if numbers(ln) and not COMMAND.search(ln)]
    assert not bad, "README.md states numbers without the command that prints them:\n" + "\n".join(bad)


def tables(text: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """{section heading: (header cells, rows of cells)} of every table under a ## heading."""
    out, head = {}, None
    for ln in text.splitlines():
        if ln.startswith("## "):
            head = ln[3:].split(" (")[0].strip()
        elif ln.startswith("|") and head is not None:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]]
            if set("".join(cells)) <= set("-: "):
                continue
            if head not in out:
                out[head] = (cells, [])
            else:
                out[head][1].append(cells)
    return out


def script_of(cmd: str) -> tuple[str, list[str]]:
    """(the file a command runs, the words after it). pytest commands: their test files."""
    words = shlex.split(cmd.strip("`"))
    words = [w for w in words if not re.match(r"[A-Z_]+=", w)]
    if "pytest" in words:
        return "pytest", words[words.index("pytest") + 1:]
    for i, w in enumerate(words):
        if w.endswith(".py"):
            return w, words[i + 1:]
        if w == "-m":
            mod = words[i + 1].replace(".", "/")
            path = mod + ".py" if os.path.exists(os.path.join(ROOT, mod + ".py")) else mod + "/__main__.py"
            return path, words[i + 2:]
    raise AssertionError(f"{cmd}: runs no script")


def check_command(cmd: str) -> list[str]:
    path, rest = script_of(cmd)
    if path == "pytest":
        files = [w for w in rest if w.startswith("tests/")]
        return [f"{cmd}: {f} does not exist" for f in files if not os.path.exists(os.path.join(ROOT, f))] or \
            ([] if files else [f"{cmd}: names no test file"])
    if not os.path.exists(os.path.join(ROOT, path)):
        return [f"{cmd}: {path} does not exist"]
    src = read(path)
    errs = [f"{cmd}: {path} defines no {w}" for w in rest if w.startswith("--") and f'"{w.split("=")[0]}"' not in src]
    for i, w in enumerate(rest[:-1]):
        if w == "--case" and rest[i + 1] not in ALL_CASES:
            errs.append(f"{cmd}: clients/cases.py has no case {rest[i + 1]}")
    return errs


def test_results_tables():
    text = read("RESULTS.md")
    found = tables(text)
    machines = {row[0] for row in tables("## machines\n" + text.split("\n## ")[0])["machines"][1]}
    assert machines >= {"2c idle", "2c shared"}, machines
    assert list(found) == AREAS, f"RESULTS.md's areas are {list(found)}; expected {AREAS}"
    errs = []
    for area, (head, rows) in found.items():
        assert head == HEADER, f"{area}: columns {head}, expected {HEADER}"
        assert rows, f"{area}: no rows"
        for r in rows:
            what, result, cmd, machine, date = r
            where = f"{area} / {what}"
            if not re.fullmatch(r"`[^`]+`", cmd):
                errs.append(f"{where}: the command cell is not one command: {cmd!r}")
                continue
            errs += [f"{where}: {e}" for e in check_command(cmd)]
            if machine not in machines:
                errs.append(f"{where}: machine {machine!r} is not in the machine table {sorted(machines)}")
            if not re.fullmatch(r"\d{4}-\d\d-\d\d", date):
                errs.append(f"{where}: date {date!r} is not YYYY-MM-DD")
    assert not errs, "\n".join(errs)


def test_results_prose_holds_no_number():
    prose = [ln for ln in FENCE.sub("", read("RESULTS.md")).splitlines() if not ln.startswith("|")]
    bad = [ln for ln in prose if numbers(ln)]
    assert not bad, "RESULTS.md prose with numbers (put them in a row with their command):\n" + "\n".join(bad)
