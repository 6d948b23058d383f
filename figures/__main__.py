"""python -m figures [module ...]: redraw every tutorial picture (or the named ones)."""
import importlib
import pkgutil
import sys
import time

import figures
from primitives.log import console


def modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(figures.__path__) if m.name.startswith("ch"))


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or modules()
    if names[:1] in (["-h"], ["--help"]):
        console.print(f"usage: {__doc__}\nmodules: {' '.join(modules())}")
        return 0
    unknown = [n for n in names if n not in modules()]
    if unknown:
        console.print(f"[red]unknown figure module(s) {unknown}; expected some of {modules()}[/red]")
        return 2
    for name in names:
        t0 = time.time()
        paths = importlib.import_module(f"figures.{name}").main()
        for p in paths:
            console.print(f"{name:24s} {time.time() - t0:6.1f}s  {p}")
    if set(names) == set(modules()):                 # the whole set: say what it leaves to others
        for png, cmd in figures.ELSEWHERE.items():
            console.print(f"[yellow]not drawn here: {png}; redraw it with {cmd}[/yellow]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
