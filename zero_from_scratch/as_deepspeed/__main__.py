"""python -m zero_from_scratch.as_deepspeed [--list] [--local_rank=N] (SCRIPT | -m MODULE) [ARGS...]

Installs the `deepspeed` finder (finder.py), says on rank 0 which DeepSpeed API ringzero serves,
and runs SCRIPT as __main__ with sys.argv = [SCRIPT, (--local_rank=N,) ARGS...] and SCRIPT's folder
first on sys.path, as `python SCRIPT` would. -m MODULE runs a module as __main__ as `python -m MODULE`
would (sys.argv[0] its file, the current folder first on sys.path); a deepspeed module is the
ringzero module serving its command line (its `main`, served.py), e.g.
  python -m zero_from_scratch.as_deepspeed -m deepspeed.checkpoint.ds_to_universal --input_folder A --output_folder B
--list prints the table (served.py) and exits.
Cost: the script's own; the banner is one line.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from rich.console import Console
from rich.table import Table

from zero_from_scratch.as_deepspeed import finder, served

USAGE = "usage: python -m zero_from_scratch.as_deepspeed [--list] [--local_rank=N] (SCRIPT | -m MODULE) [ARGS...]"


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(SCRIPT, the script's argv after its name): the launcher's --local_rank goes to the script;
    ("-m MODULE", its argv) for -m MODULE."""
    head, i = [], 0
    while i < len(argv) and argv[i].startswith("--local_rank"):
        if argv[i] == "--local_rank" and i + 1 < len(argv):
            head += argv[i:i + 2]
            i += 2
        else:
            head.append(argv[i])
            i += 1
    if argv[i:i + 1] == ["-m"] and i + 1 < len(argv):
        return "-m " + argv[i + 1], head + argv[i + 2:]
    if i >= len(argv) or argv[i].startswith("-"):
        raise SystemExit(USAGE)
    return argv[i], head + argv[i + 1:]


def served_main_module(name: str) -> str:
    """The module to run for `-m name`: a deepspeed module's command line is the ringzero module serving
    its main (served.py); any other module is itself."""
    if name.split(".")[0] != "deepspeed":
        return name
    target = served.SERVED.get(f"{name}.main") or served.SERVED.get(f"{name}.*")
    mod = target.split(":")[0] if target else None
    spec = importlib.util.find_spec(mod) if mod else None
    if spec is None or '__name__ == "__main__"' not in open(spec.origin).read():
        raise SystemExit(f"as_deepspeed: -m {name}: ringzero serves no command line for it (DeepSpeed would run "
                         "the module's __main__ block); --list shows what is served")
    return mod


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
    if script.startswith("-m "):
        run_module(script[3:], args)
        return
    if not os.path.isfile(script):
        raise SystemExit(f"as_deepspeed: no such script {script!r}\n{USAGE}")
    finder.install()
    if os.environ.get("RANK", "0") == "0":
        Console(stderr=True).print(f"[bold]ringzero[/] serves [cyan]deepspeed[/] (DeepSpeed {served.VERSION}'s API) "
                                   f"for {script}; the installed DeepSpeed package is not imported")
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def run_module(name: str, args: list[str]) -> None:
    finder.install()
    mod = served_main_module(name)
    if os.environ.get("RANK", "0") == "0":
        Console(stderr=True).print(f"[bold]ringzero[/] serves [cyan]deepspeed[/] (DeepSpeed {served.VERSION}'s API) "
                                   f"for -m {name}" + (f" (runs {mod})" if mod != name else "")
                                   + "; the installed DeepSpeed package is not imported")
    sys.argv = [name, *args]                 # runpy puts the module's file first, as python -m does
    sys.path[0] = os.getcwd()
    runpy.run_module(mod, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
