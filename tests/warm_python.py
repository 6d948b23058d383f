"""Run many Python scripts fast: the heavy imports happen once, then each script runs in a forked
child with the sys.path, sys.argv and working directory that `python PATH ARGS` or `python -m MODULE
ARGS` would give it, and the interpreter's exit (threads joined, atexit handlers) after it. The
repository's own modules are imported afresh in each child, so a script that only works from one
place still fails here, and so does a script that uses a module it did not import.

    python tests/warm_python.py --help-of path:classification/train.py module:zero_from_scratch.engine.report
    python tests/warm_python.py --serve       # a JSON request a line on stdin: {"target", "argv", "timeout"}

Each run prints one line `warm-result {"target", "rc", "out"}` (out: stdout and stderr together; the
first 4,000 characters under --help-of; rc −14 when the timeout's SIGALRM ended it). --help-of runs
TARGET --help for each target; --serve runs a request's target with its argv, answers with the
request's "id", and stops at the end of its input. Unlike a fresh interpreter, a child inherits what
the warm imports did: numpy's global random state (the same in every child), and torch imported
before the script could set a variable torch reads at import. Warm: torch, numpy and rich; and
for --help-of the modules most scripts import at the top (transformers' models, torch.distributed's
checkpoint and elastic), which make every fork slower where a script does not need them.
Cost: a fork and the script's own imports per run, instead of an interpreter and torch (~2.3 CPU s here).
"""
import json
import os
import runpy
import signal
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.remove(os.path.dirname(os.path.abspath(__file__)))     # this folder is not on a script's path

import numpy  # noqa: E402,F401
import rich  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401


def child(kind: str, name: str, argv: list[str]) -> None:
    if kind == "path":
        path = name if os.path.isabs(name) else os.path.join(ROOT, name)
        sys.path.insert(0, os.path.dirname(path))
        sys.argv = [path, *argv]
        runpy.run_path(path, run_name="__main__")
    else:
        sys.path.insert(0, os.getcwd())     # python -m puts the working directory first
        sys.argv = [name, *argv]
        runpy.run_module(name, run_name="__main__", alter_sys=True)


def _exit_code(e: SystemExit) -> int:
    if isinstance(e.code, int):
        return e.code
    if e.code is not None:
        print(e.code, file=sys.stderr)      # what the interpreter prints for SystemExit("text")
    return 0 if e.code is None else 1


def run(target: str, argv: list[str], timeout: int, limit: int | None = None) -> dict:
    kind, name = target.split(":", 1)
    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            signal.alarm(timeout)           # a script that does not stop is a failure, not a hang
            os.chdir(ROOT)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)                # the requests' pipe is not the script's input
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            code = 0
            try:
                child(kind, name, argv)
            except SystemExit as e:
                code = _exit_code(e)
            except BaseException:
                sys.excepthook(*sys.exc_info())
                code = 1
            try:                            # the interpreter's exit: non-daemon threads, then atexit
                threading._shutdown()
                import atexit
                atexit._run_exitfuncs()
            except SystemExit as e:
                code = _exit_code(e)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        text = out.read()
        return {"target": target, "rc": os.waitstatus_to_exitcode(status), "out": text[:limit] if limit else text}


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        res = run(req["target"], req.get("argv", []), int(req.get("timeout", 600)))
        print("warm-result", json.dumps({**res, "id": req.get("id")}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve()
    elif sys.argv[1:2] == ["--help-of"]:
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.elastic.events  # noqa: F401
        import transformers  # noqa: F401
        import transformers.modeling_utils  # noqa: F401   (these pull torch.distributed.tensor, dynamo, sympy)
        for t in sys.argv[2:]:
            print("warm-result", json.dumps(run(t, ["--help"], 120, limit=4000)), flush=True)
    else:
        raise SystemExit("usage: warm_python.py --help-of TARGET... | --serve")
