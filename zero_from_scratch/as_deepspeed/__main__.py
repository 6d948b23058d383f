"""python -m zero_from_scratch.as_deepspeed [--list] [--local_rank=N] SCRIPT [ARGS...]

Installs the `deepspeed` finder (finder.py), says on rank 0 which DeepSpeed API ringzero serves,
and runs SCRIPT as __main__ with sys.argv = [SCRIPT, (--local_rank=N,) ARGS...] and SCRIPT's folder
first on sys.path, as `python SCRIPT` would. --list prints the table (served.py) and exits.
Cost: the script's own; the banner is one line.
"""
from __future__ import annotations

import os
import runpy
import sys

from rich.console import Console
from rich.table import Table

from zero_from_scratch.as_deepspeed import finder, served

USAGE = "usage: python -m zero_from_scratch.as_deepspeed [--list] [--local_rank=N] SCRIPT [ARGS...]"


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(SCRIPT, the script's argv after its name): the launcher's --local_rank goes to the script."""
    head, i = [], 0
    while i < len(argv) and argv[i].startswith("--local_rank"):
        if argv[i] == "--local_rank" and i + 1 < len(argv):
            head += argv[i:i + 2]
            i += 2
        else:
            head.append(argv[i])
            i += 1
    if i >= len(argv) or argv[i].startswith("-"):
        raise SystemExit(USAGE)
    return argv[i], head + argv[i + 1:]


def print_table() -> None:
    t = Table(title=f"deepspeed names served by ringzero (DeepSpeed {served.VERSION} API)")
    for col in ("deepspeed name", "ringzero", "now"):
        t.add_column(col)
    for name, target in sorted(served.SERVED.items()):
        try:
            if not name.endswith("*"):
                finder.resolve(name, target)          # an empty list is served too
            ok = "served"
        except finder.NotServedAttributeError:
            ok = "missing"
        t.add_row(name, target, ok)
    for name, (what, nearest) in sorted(served.REFUSED.items()):
        t.add_row(name, f"refused: {nearest}", "refused")
    Console().print(t)


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1].strip())
        return
    if argv[:1] == ["--list"]:
        finder.install()
        print_table()
        return
    script, args = split_argv(argv)
    if not os.path.isfile(script):
        raise SystemExit(f"as_deepspeed: no such script {script!r}\n{USAGE}")
    finder.install()
    if os.environ.get("RANK", "0") == "0":
        Console(stderr=True).print(f"[bold]ringzero[/] serves [cyan]deepspeed[/] (DeepSpeed {served.VERSION}'s API) "
                                   f"for {script}; the installed DeepSpeed package is not imported")
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
