"""How big the textbook is, and what a learner must open to follow one idea.

    python -m benchmarks.textbook                 (tables: READING.md's entries, textbook vs engine lines)
    python -m pytest -q tests/test_layout.py      (the rules computed here, as tests)

The textbook is the set of files READING.md names; the engine is every other production file.
For an idea (one READING.md entry) this prints
    lines to open   its own file plus every textbook file it imports, transitively (`wc -l`);
                    beside it, the same with every engine file those imports reach
    lines of idea   the lines of the named function, class or method (its `def`/`class` to its end)
Everything is read from the source with `ast`: no module is imported.
"""
from __future__ import annotations

import ast
import io
import os
import re
import sys
import tokenize
from dataclasses import dataclass
from functools import lru_cache

from rich.console import Console
from rich.table import Table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("primitives", "ddp_examples", "zero_from_scratch", "pipeline_parallel", "tensor_parallel",
            "classification", "recipes", "seq2seq", "figures", "benchmarks", "multinode", "parity", "planner")
TEXTBOOK_BUDGET = 3000
# one line of READING.md's list: `- <idea>: <path>::<function or Class or Class.method>`
ENTRY = re.compile(r"^- (?P<idea>[^:`]+): (?P<path>[\w/]+\.py)::(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)$")
# the ideas whose cost to read is measured: an idea and the READING.md entries it is made of
IDEAS = {"ring all-reduce": ["ring all-reduce"], "ZeRO-3": ["ZeRO-3"], "1F1B": ["1F1B"],
         "column/row parallel": ["column parallel", "row parallel"]}


@dataclass(frozen=True)
class Entry:
    idea: str
    path: str        # relative to ROOT
    name: str        # function, Class or Class.method
    line: int        # its line in READING.md


@dataclass(frozen=True)
class Import:
    target: str        # the imported module, resolved to the deepest module of this tree, else as written
    line: int
    in_function: bool  # inside a def (at any depth)
    why: str           # the comment on the statement's lines, noqa markers removed ('' if none)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def lines(path: str) -> int:
    """`wc -l`."""
    return read(path).count("\n")


def production_files() -> list[str]:
    """Every .py file of the packages (tests/ is not production)."""
    out = []
    for pkg in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__pycache__")))
            out += [os.path.relpath(os.path.join(d, f), ROOT) for f in sorted(files) if f.endswith(".py")]
    return out


def module_of(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def modules() -> dict[str, str]:
    """module name → path, for every production file."""
    return {module_of(p): p for p in production_files()}


def _resolve(name: str) -> str:
    """The deepest module of this tree that `name` names (a.b.c → a.b when c is an attribute)."""
    mods, parts = modules(), name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return ".".join(parts[:i])
    return name


def _comments(src: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = re.sub(r"noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?|type:\s*ignore\S*", "", tok.string.lstrip("#"))
            out[tok.start[0]] = text.strip(" \t-—:;,")
    return out


@lru_cache(maxsize=None)
def imports(path: str) -> tuple[Import, ...]:
    """Every import statement of a file: at module level, under `if`, in try blocks and inside functions."""
    src = read(path)
    tree, notes = ast.parse(src, path), _comments(src)
    package = module_of(path) if path.endswith("__init__.py") else module_of(path).rpartition(".")[0]
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                why = " ".join(notes.get(n, "") for n in range(child.lineno, child.end_lineno + 1)).strip()
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    names = [f"{base}.{a.name}" if a.name != "*" else base for a in child.names]
                for n in names:
                    imp = Import(_resolve(n), child.lineno, in_function, why)
                    if imp not in out:
                        out.append(imp)
            visit(child, inner)

    visit(tree, False)
    return tuple(out)


def graph() -> dict[str, set[str]]:
    """module → the modules of this tree it imports (every import statement counts)."""
    mods = modules()
    return {m: {i.target for i in imports(p) if i.target in mods and i.target != m} for m, p in mods.items()}


def reading_lines(text: str | None = None) -> list[tuple[int, str]]:
    """(line number, line) of every list item of READING.md."""
    text = read("READING.md") if text is None else text
    return [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.startswith(("- ", "* ", "+ "))]


def reading_entries(text: str | None = None) -> list[Entry]:
    """READING.md's entries, in reading order (lines not of the form are left out: see reading_lines)."""
    return [Entry(m["idea"], m["path"], m["name"], n)
            for n, ln in reading_lines(text) if (m := ENTRY.match(ln))]


def node(path: str, name: str):
    """The ast node of function/Class/Class.method `name` in path, or None."""
    body, found = ast.parse(read(path)).body, None
    for part in name.split("."):
        found = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and n.name == part), None)
        if found is None:
            return None
        body = found.body
    return found


def _length(n) -> int:
    return n.end_lineno - min([n.lineno] + [d.lineno for d in n.decorator_list]) + 1


def def_lines(path: str, name: str) -> int | None:
    """Lines of function/Class/Class.method `name` in path (decorators to its end), or None."""
    n = node(path, name)
    return None if n is None else _length(n)


def textbook_files(entries: list[Entry] | None = None) -> list[str]:
    out = []
    for e in entries if entries is not None else reading_entries():
        if e.path not in out:
            out.append(e.path)
    return out


def textbook_closure(path: str, textbook: list[str] | None) -> list[str]:
    """path plus every textbook file it imports, transitively, through textbook files only
    (textbook None: every production file it imports, the engine's included)."""
    mods, g = modules(), graph()
    seen, todo = [path], [path]
    while todo:
        for m in sorted(g.get(module_of(todo.pop()), ())):
            p = mods[m]
            if (textbook is None or p in textbook) and p not in seen:
                seen.append(p)
                todo.append(p)
    return seen


def _defs(path: str) -> dict[str, tuple[str, ast.AST]]:
    """name usable in path → (defining file, top-level def/class): its own and those it imports by name."""
    tree, mods = ast.parse(read(path)), modules()
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and not n.level and n.module in mods:
            for a in n.names:
                there = next((d for d in ast.parse(read(mods[n.module])).body if getattr(d, "name", None) == a.name
                              and isinstance(d, (ast.FunctionDef, ast.ClassDef))), None)
                if there is not None:
                    out[a.asname or a.name] = (mods[n.module], there)
    for d in tree.body:
        if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[d.name] = (path, d)
    return out


def idea_lines(entry: Entry, textbook: list[str]) -> int:
    """Lines of the named def, plus every textbook function/class it calls by name, transitively."""
    n = node(entry.path, entry.name)
    if n is None:
        return 0
    seen, todo, total = {(entry.path, n.lineno)}, [(entry.path, n)], 0
    while todo:
        path, n = todo.pop()
        total += _length(n)
        defs = _defs(path)
        for x in ast.walk(n):
            name = x.id if isinstance(x, ast.Name) else None
            if name in defs:
                where, d = defs[name]
                if where in textbook and (where, d.lineno) not in seen and not _inside(d, n, where, path):
                    seen.add((where, d.lineno))
                    todo.append((where, d))
    return total


def _inside(d, n, where, path) -> bool:
    return where == path and n.lineno <= d.lineno <= n.end_lineno


def idea_rows(entries: list[Entry]) -> list[tuple[str, list[str], int, int, int]]:
    """(idea, files to open, lines to open, lines of the idea, lines with the engine files it imports)."""
    book, by_idea, rows = textbook_files(entries), {e.idea: e for e in entries}, []
    for idea, parts in IDEAS.items():
        es = [by_idea[p] for p in parts if p in by_idea]
        if not es:
            continue
        files, every = [], []
        for e in es:
            files += [f for f in textbook_closure(e.path, book) if f not in files]
            every += [f for f in textbook_closure(e.path, None) if f not in every]
        rows.append((idea, files, sum(lines(f) for f in files), sum(idea_lines(e, book) for e in es),
                     sum(lines(f) for f in every)))
    return rows


def main() -> None:
    console = Console(width=max(Console().width, 150))
    entries = reading_entries()
    book = textbook_files(entries)
    t = Table(title="READING.md: the textbook, in reading order")
    for c in ("idea", "entry", "lines of it", "file lines"):
        t.add_column(c, justify="right" if "lines" in c else "left")
    for e in entries:
        n = def_lines(e.path, e.name)
        t.add_row(e.idea, f"{e.path}::{e.name}", "MISSING" if n is None else str(n), str(lines(e.path)))
    console.print(t)

    per_pkg: dict[str, list[int]] = {}
    for p in production_files():
        per_pkg.setdefault(p.split("/")[0], [0, 0])[0 if p in book else 1] += lines(p)
    t = Table(title=f"textbook vs engine, lines (`wc -l`); textbook budget {TEXTBOOK_BUDGET:,}")
    for c in ("package", "textbook", "engine + applications"):
        t.add_column(c, justify="left" if c == "package" else "right")
    for pkg in PACKAGES:
        a, b = per_pkg.get(pkg, [0, 0])
        t.add_row(pkg, f"{a:,}", f"{b:,}")
    total = sum(lines(p) for p in book)
    t.add_row("total", f"{total:,} / {TEXTBOOK_BUDGET:,}", f"{sum(v[1] for v in per_pkg.values()):,}", style="bold")
    console.print(t)

    t = Table(title="what a learner opens to follow an idea")
    for c in ("idea", "files", "lines to open", "lines of the idea", "share", "+ engine files it imports"):
        t.add_column(c, justify="left" if c in ("idea", "files") else "right")
    for idea, files, opened, own, every in idea_rows(entries):
        t.add_row(idea, " ".join(f.rsplit("/", 1)[-1] for f in files), f"{opened:,}", f"{own:,}",
                  f"{own / opened:.0%}" if opened else "-", f"{every:,}")
    console.print(t)
    sys.exit(0 if total <= TEXTBOOK_BUDGET else 1)


if __name__ == "__main__":
    main()
