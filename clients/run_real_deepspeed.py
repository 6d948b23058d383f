"""Run a DeepSpeed client script under the REAL DeepSpeed, as the reference side of a comparison.

    deepspeed --num_gpus 2 --master_port P clients/run_real_deepspeed.py SCRIPT [ARGS...]

The same command line as `--module zero_from_scratch.as_deepspeed SCRIPT ARGS`, with one
difference that changes no number: DeepSpeed's `deepspeed_shm_comm` op (inference all-reduce
only) is marked incompatible so that it is not JIT-built (~1-2 min of g++ on this machine), as
zero_from_scratch/parity/sides.py::skip_shm_op_build explains. Cost: importing DeepSpeed.
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zero_from_scratch.as_deepspeed.__main__ import split_argv  # noqa: E402  (the repo root goes on sys.path first)
from zero_from_scratch.parity.sides import skip_shm_op_build  # noqa: E402

if __name__ == "__main__":
    script, args = split_argv(sys.argv[1:])
    skip_shm_op_build()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
