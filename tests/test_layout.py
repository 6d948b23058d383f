"""The rules the tree keeps, computed from the source with `ast` (benchmarks/textbook.py reads it).

    python -m pytest -q tests/test_layout.py

Every `import` statement counts: at module level, under `if __name__ == "__main__"`, in try blocks
and inside functions (a cycle closed by a lazy import is still a cycle). Each test lists every
violation it finds, so a failure names the file and line to fix.
"""
import os
import re
import subprocess
import sys

from benchmarks import textbook as T

PROD = T.production_files()
BELOW_APPS = {"primitives", "ddp_examples", "zero_from_scratch", "pipeline_parallel", "tensor_parallel"}
# package → the packages it may import (itself always)
ARROWS = {
    "primitives": set(),
    "ddp_examples": {"primitives"},
    "tensor_parallel": {"primitives"},
    "zero_from_scratch": {"primitives"},
    "pipeline_parallel": {"primitives", "zero_from_scratch", "tensor_parallel"},
    "classification": BELOW_APPS,
    "recipes": BELOW_APPS,
    "seq2seq": BELOW_APPS,
    "figures": set(T.PACKAGES),
    "benchmarks": set(T.PACKAGES),
    "multinode": {"primitives"},
    # the parity harnesses (each layer against DeepSpeed, one process, torch) and the planner sit beside
    # figures and benchmarks: they may import any library package, and only tests/figures/benchmarks import them
    "parity": BELOW_APPS | {"classification"},   # parity/classification.py: the classification model's report
    "planner": BELOW_APPS,
}
# words a reader of the repository alone cannot resolve: process stops, sessions' guides, issue numbers,
# an earlier version of the code, a file's former name
UNRESOLVABLE = [r"\bstop \d+", r"\bGUIDE(\.md)? ?§", r"\bthe seed('s)?\b", r"\bthe issue('s)?\b", r"\bissue \d+",
                r"\(was [\w./-]+\)"]
THIRD_PARTY = {"torch", "numpy"}


def _fail(what: str, bad: list[str]) -> None:
    assert not bad, f"{len(bad)} {what}:\n  " + "\n  ".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle through it."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for comp in comps:                       # the shortest way back to the first module, by breadth
        start = min(comp)
        prev, todo = {start: None}, [start]
        while todo and start not in [w for v in todo for w in graph[v] if w == start]:
            nxt = []
            for v in todo:
                for w in sorted(graph[v] & comp):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            todo = nxt
        last = next(v for v in todo if start in graph[v])
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        out.append(path[::-1] + [start] + ([f"(+{len(comp) - len(path)} more in this cycle)"]
                                            if len(comp) > len(path) else []))
    return out


def test_no_import_cycles():
    _fail("import cycles among production modules", [" → ".join(c) for c in _cycles(T.graph())])


def test_package_arrows_point_down():
    bad = []
    for path in PROD:
        pkg = path.split("/")[0]
        for imp in T.imports(path):
            top = imp.target.split(".")[0]
            if top in T.PACKAGES and top != pkg and top not in ARROWS[pkg]:
                bad.append(f"{path}:{imp.line}: {pkg} → {top} ({imp.target})")
    _fail("package arrows that point sideways or up", bad)


def test_production_files_are_at_most_300_lines():
    _fail("production files over 300 lines", [f"{p}: {n}" for p in PROD if (n := T.lines(p)) > 300])


def test_imports_inside_functions_say_why():
    _fail("imports inside a function without a comment saying why (move it to the top, or say why)",
          [f"{p}:{i.line}: {i.target}" for p in PROD for i in T.imports(p) if i.in_function and not i.why])


def test_reading_lines_have_the_form():
    bad = [f"READING.md:{n}: {ln}" for n, ln in T.reading_lines() if not T.ENTRY.match(ln)]
    _fail("READING.md list lines not of the form `- <idea>: <path>::<function or Class or Class.method>`", bad)
    assert T.reading_entries(), "READING.md names no entry"


def test_reading_entries_resolve():
    bad = []
    for e in T.reading_entries():
        if not os.path.isfile(os.path.join(T.ROOT, e.path)):
            bad.append(f"READING.md:{e.line}: {e.path} does not exist")
        elif T.node(e.path, e.name) is None:
            bad.append(f"READING.md:{e.line}: {e.path} defines no {e.name}")
    _fail("READING.md entries that do not resolve", bad)


def test_textbook_is_at_most_3000_lines():
    files = [f for f in T.textbook_files() if os.path.isfile(os.path.join(T.ROOT, f))]
    total = sum(T.lines(f) for f in files)
    assert total <= T.TEXTBOOK_BUDGET, f"the textbook is {total} lines > {T.TEXTBOOK_BUDGET}: " + ", ".join(
        f"{f} {T.lines(f)}" for f in files)


def test_textbook_imports_only_stdlib_torch_numpy_and_itself():
    files = [f for f in T.textbook_files() if os.path.isfile(os.path.join(T.ROOT, f))]
    book = {T.module_of(f) for f in files}
    bad = []
    for f in files:
        for imp in T.imports(f):
            top = imp.target.split(".")[0]
            if imp.target in book or top in sys.stdlib_module_names or top in THIRD_PARTY:
                continue
            bad.append(f"{f}:{imp.line}: {imp.target}")
    _fail("textbook imports of something else than stdlib, torch, numpy or a textbook file", bad)


def test_importing_the_textbook_loads_no_engine_module():
    mods = sorted({T.module_of(f) for f in T.textbook_files() if os.path.isfile(os.path.join(T.ROOT, f))})
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            f"print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in {set(T.PACKAGES)!r} "
            "and '.engine' in m)))")
    env = dict(os.environ, PYTHONPATH=T.ROOT)
    r = subprocess.run([sys.executable, "-c", code], cwd=T.ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    _fail("engine modules loaded by importing the textbook", r.stdout.split())


def test_no_words_a_reader_cannot_resolve():
    files = PROD + ["README.md", "READING.md"] + sorted(
        f"tutorials/{f}" for f in os.listdir(os.path.join(T.ROOT, "tutorials")) if f.endswith(".md"))
    pat = re.compile("|".join(UNRESOLVABLE))
    bad = [f"{f}:{n}: {m.group(0)!r}" for f in files if os.path.isfile(os.path.join(T.ROOT, f))
           for n, ln in enumerate(T.read(f).splitlines(), 1) for m in pat.finditer(ln)]
    _fail("words a reader of the repository alone cannot resolve", bad)


def test_every_tutorial_chapter_names_its_textbook_entries():
    """Each chapter opens with a line linking READING.md and the entries it teaches; each of them is
    a READING.md entry (so a renamed or moved idea breaks the chapter here, not in a reader's hands)."""
    known = {f"{e.path}::{e.name}" for e in T.reading_entries()}
    tut = os.path.join(T.ROOT, "tutorials")
    bad = []
    for f in sorted(x for x in os.listdir(tut) if re.match(r"\d\d_.*\.md$", x)):
        line = next((ln for ln in open(os.path.join(tut, f)) if ln.startswith("**In the textbook** ([READING.md]")), "")
        named = re.findall(r"\[`([^`]+)`\]", line)
        if not named:
            bad.append(f"{f}: no '**In the textbook** ([READING.md](../READING.md)): ...' line")
        bad += [f"{f}: {n} is not a READING.md entry" for n in named if n not in known]
    _fail("tutorial chapters without their textbook entries", bad)
