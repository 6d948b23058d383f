"""The rules the tree keeps, computed from the source with `ast` (benchmarks/textbook.py reads it).

    python -m pytest -q tests/test_layout.py

Every `import` statement counts: at module level, under `if __name__ == "__main__"`, in try blocks
and inside functions (a cycle closed by a lazy import is still a cycle). Each test lists every
violation it finds, so a failure names the file and line to fix.
"""
import ast
import os
import re
import subprocess
import sys
from functools import lru_cache

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
    "parity": BELOW_APPS | {"classification"},   # parity/distilbert.py: the classification model's report
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


# ----------------------------------------------------------------------------- the engine extends the textbook

def _names(path: str) -> dict[str, tuple]:
    """name usable at module level of `path` → ("module", dotted) or ("class", (file, class name))."""
    tree, mods, out = ast.parse(T.read(path)), T.modules(), {}
    package = T.module_of(path) if path.endswith("__init__.py") else T.module_of(path).rpartition(".")[0]
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                out[a.asname or a.name.split(".")[0]] = ("module", a.name if a.asname else a.name.split(".")[0])
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = package.split(".")[: len(package.split(".")) - n.level + 1]
                base = ".".join(up + ([n.module] if n.module else []))
            for a in n.names:
                out[a.asname or a.name] = ("module", f"{base}.{a.name}") if f"{base}.{a.name}" in mods else \
                    ("from", (base, a.name))
    for d in tree.body:
        if isinstance(d, ast.ClassDef):
            out[d.name] = ("class", (path, d.name))
    return out


@lru_cache(maxsize=None)
def _class_in(module: str, name: str, depth: int = 0):
    """(file, class name) of class `name` as module `module` exposes it (following re-exports), or None."""
    path = T.modules().get(module)
    if path is None or depth > 8:
        return None
    got = _names(path).get(name)
    if got is None or got[0] == "module":
        return None
    return got[1] if got[0] == "class" else _class_in(*got[1], depth + 1)


def _resolve_class(path: str, expr):
    """(file, class name) a base-class expression of `path` names, or None (outside the tree)."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    got = _names(path).get(expr.id)
    if got is None:
        return None
    if got[0] == "class":
        return got[1] if not parts else None
    if got[0] == "from":
        return _class_in(*got[1]) if not parts else _class_in(".".join(got[1]) + "." + ".".join(parts[:-1]),
                                                                 parts[-1]) if len(parts) > 1 else \
            _class_in(".".join(got[1]), parts[0])
    return _class_in(".".join([got[1]] + parts[:-1]), parts[-1]) if parts else None


@lru_cache(maxsize=None)
def _class_table() -> dict[tuple[str, str], tuple[ast.ClassDef, list]]:
    """(file, class name) → (its ClassDef, the classes of this tree its bases name) for every production
    class at module level, and for classes defined inside functions (keyed by name@line)."""
    out = {}
    for path in PROD:
        tree = ast.parse(T.read(path))
        top = {id(d) for d in tree.body}
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                key = (path, n.name if id(n) in top else f"{n.name}@{n.lineno}")
                out[key] = (n, [b for b in (_resolve_class(path, e) for e in n.bases) if b is not None])
    return out


def _mro(key, table, seen=()) -> list:
    """C3 linearization over the bases this tree defines (outside ones, like nn.Module, left out)."""
    if key not in table or key in seen:
        return [key]
    seqs = [_mro(b, table, seen + (key,)) for b in table[key][1]] + [list(table[key][1])]
    out = [key]
    while any(seqs):
        seqs = [s for s in seqs if s]
        head = next((s[0] for s in seqs if not any(s[0] in t[1:] for t in seqs)), seqs[0][0])
        out.append(head)
        seqs = [s[1:] if s[0] == head else s for s in seqs]
    return out


def _methods(cls: ast.ClassDef) -> dict[str, ast.AST]:
    return {d.name: d for d in cls.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _extension_point(fn) -> bool:
    """A textbook method left to subclasses: its body (docstring aside) raises NotImplementedError, or abstract."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if any("abstractmethod" in ast.unparse(d) for d in fn.decorator_list):
        return True
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


def _calls_up(path: str, fn, name: str, ancestors: set) -> bool:
    """Does `fn` call `super().name(...)` or `Base.name(...)` for a class Base among `ancestors`?"""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name:
            v = n.func.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                return True
            if _resolve_class(path, v) in ancestors:
                return True
    return False


def replacing_overrides() -> list[tuple[tuple[str, str], str, tuple[str, str]]]:
    """(engine class, method, textbook class) for every engine method that takes a textbook method's
    place in some class's method resolution order without calling it (extension points aside)."""
    table, book = _class_table(), set(T.textbook_files())
    out = set()
    for key in table:
        mro = [k for k in _mro(key, table) if k in table]
        for i, eng in enumerate(mro):
            if eng[0] in book:
                continue
            for m, fn in _methods(table[eng][0]).items():
                # the textbook definition this one takes the place of: the first one after it in the order
                tb = next((k for k in mro[i + 1:] if k[0] in book and m in _methods(table[k][0])), None)
                if tb is None or _extension_point(_methods(table[tb][0])[m]):
                    continue
                if not _calls_up(eng[0], fn, m, set(_mro(eng, table)[1:])):
                    out.add((eng, m, tb))
    return sorted(out)


def test_engine_overrides_of_reading_methods_call_the_textbook():
    """An engine method that overrides a method READING.md names (a `Class.method` entry, or any method of
    a `Class` entry) calls it: `super().m(...)` or `Base.m(self, ...)`. Printed: every such override that
    does not, then the count over every textbook class (informational)."""
    named = {(e.path, e.name.split(".")[0], e.name.split(".")[1] if "." in e.name else None)
             for e in T.reading_entries()}
    every = replacing_overrides()
    bad = [f"{e[0]}::{e[1]}.{m} replaces {t[0]}::{t[1]}.{m}" for e, m, t in every
           if (t[0], t[1], m) in named or (t[0], t[1], None) in named]

    def by_package(rows) -> str:
        count: dict[str, int] = {}
        for r in rows:
            count[r.split("/")[0]] = count.get(r.split("/")[0], 0) + 1
        return ", ".join(f"{k} {v}" for k, v in sorted(count.items())) or "none"

    print(f"\nengine overrides of READING.md methods that do not call them: {len(bad)} ({by_package(bad)})")
    print("\n".join("  " + b for b in bad))
    print(f"engine overrides of any textbook class's method that do not call it: {len(every)} "
          f"({by_package([e[0] for e, _, _ in every])})")
    print("\n".join(f"  {e[0]}::{e[1]}.{m} replaces {t[0]}::{t[1]}.{m}" for e, m, t in every))
    _fail("engine overrides of READING.md methods that do not call the textbook's", bad)
