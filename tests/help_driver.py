"""Run `--help` of many scripts fast: the heavy third-party imports happen once, then each script
runs in a forked child with the sys.path and sys.argv that `python PATH --help` or
`python -m MODULE --help` would give it (the repository's own modules are imported afresh in
each child, so a script that only works from one place still fails here).

    python tests/help_driver.py path:classification/train.py module:zero_from_scratch.engine.report

Prints one line per target: `help-result {"target", "rc", "out"}` (out: stdout + stderr, the first 4,000 characters).
"""
import json
import os
import runpy
import signal
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.remove(os.path.dirname(os.path.abspath(__file__)))     # this folder is not on a script's path

import numpy  # noqa: E402,F401
import rich  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import transformers  # noqa: E402,F401
import transformers.modeling_utils  # noqa: E402,F401   (these pull torch.distributed.tensor, dynamo, sympy)
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.elastic.events  # noqa: E402,F401


def child(kind: str, name: str) -> None:
    signal.alarm(120)                       # a script that does not stop at --help is a failure, not a hang
    if kind == "path":
        path = os.path.join(ROOT, name)
        sys.path.insert(0, os.path.dirname(path))
        sys.argv = [path, "--help"]
        runpy.run_path(path, run_name="__main__")
    else:
        sys.path.insert(0, ROOT)            # python -m puts the working directory first
        sys.argv = [name, "--help"]
        runpy.run_module(name, run_name="__main__", alter_sys=True)


def run(target: str) -> dict:
    kind, name = target.split(":", 1)
    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.chdir(ROOT)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            code = 0
            try:
                child(kind, name)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)      # what the interpreter prints for SystemExit("text")
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        rc = os.waitstatus_to_exitcode(status)
        return {"target": target, "rc": rc, "out": out.read()[:4000]}


if __name__ == "__main__":
    for t in sys.argv[1:]:
        print("help-result", json.dumps(run(t)), flush=True)   # the imports above print too
