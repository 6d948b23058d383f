"""Run a DeepSpeed client script on either side of a comparison, from the same start-up seed.

    torchrun --nproc_per_node 2 clients/run.py deepspeed SCRIPT [ARGS...]    (the installed DeepSpeed)
    torchrun --nproc_per_node 2 clients/run.py ringzero SCRIPT [ARGS...]     (= -m zero_from_scratch.as_deepspeed)

Python starts torch's generator from a random seed, so two runs of an upstream script that never
seeds (cifar10_deepspeed.py builds its model unseeded) differ by their initial weights alone.
This harness seeds random, numpy and torch with $CLIENT_SEED (default 0) before the script runs,
the same on both sides; nothing else differs from the plain commands, except that on the
deepspeed side the `deepspeed_shm_comm` op (inference all-reduce only) is marked incompatible so
it is not JIT-built (zero_from_scratch/engine/real_deepspeed.py::skip_shm_op_build). The deepspeed
launcher's --local_rank=N (first on the command line) is handed on to the script.
CLIENT_TRACE=1 also counts the DeepSpeed calls the script makes and prints them at exit (clients/trace.py).
Cost: the script's own.
"""
import os
import random
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402  (the repo root goes on sys.path first)
import torch  # noqa: E402

from zero_from_scratch.as_deepspeed import finder  # noqa: E402
from zero_from_scratch.as_deepspeed.__main__ import main as ringzero_main, split_argv  # noqa: E402

SIDES = ("deepspeed", "ringzero")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def trace_calls(side: str) -> None:
    """CLIENT_TRACE=1: count the DeepSpeed calls the script makes (clients/trace.py), on either side."""
    import importlib   # both imports only when tracing: the plain run stays as the script's own
    from clients import trace
    if side == "ringzero":
        finder.install()   # `deepspeed` resolves to ringzero's from here on, as the runner would make it
    trace.install(importlib.import_module("deepspeed"))


if __name__ == "__main__":
    argv = sys.argv[1:]
    usage = f"usage: clients/run.py {{{','.join(SIDES)}}} [--local_rank=N] SCRIPT [ARGS...]"
    if argv[:1] in (["-h"], ["--help"]):
        raise SystemExit(print(f"{usage}\n\n{__doc__.strip()}"))
    side = next((a for a in argv if not a.startswith("--local_rank")), None)
    if side not in SIDES:
        raise SystemExit(usage)
    argv.remove(side)
    seed_everything(int(os.environ.get("CLIENT_SEED", "0")))
    if side == "ringzero":
        if os.environ.get("CLIENT_TRACE"):
            trace_calls("ringzero")
        ringzero_main(argv)
    else:
        from zero_from_scratch.engine.real_deepspeed import skip_shm_op_build  # imports the real DeepSpeed: this side only
        script, args = split_argv(argv)
        skip_shm_op_build()
        if os.environ.get("CLIENT_TRACE"):
            trace_calls("deepspeed")
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
