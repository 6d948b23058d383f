"""Run, verify and time every algorithm of one collective against the backend's own.

    torchrun --nproc_per_node 4 primitives/run.py broadcast [--size 1048576] [--iters 5]
    torchrun --nproc_per_node 4 primitives/run.py all_to_all
    mpiexec -n 4 python primitives/run.py gather --backend mpi

NAME: all_reduce, broadcast, reduce, all_gather, reduce_scatter, scatter, gather, all_to_all
(the algorithms: primitives/NAME.py). all_reduce, all_gather and reduce_scatter also have their
own scripts: allreduce.py, allgather.py, reducescatter.py.
"""
import sys

from primitives.engine import runner

NAMES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "scatter", "gather", "all_to_all")

if __name__ == "__main__":
    usage = f"usage: primitives/run.py NAME [--size BYTES] [--iters N] [--backend ...]; NAME is one of {NAMES}"
    if sys.argv[1:2] in (["-h"], ["--help"]):
        raise SystemExit(print(f"{usage}\n\n{__doc__.strip()}"))
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        raise SystemExit(usage)
    name, argv = sys.argv[1], sys.argv[2:]
    if name == "all_to_all":
        runner.main_all_to_all(argv)
    else:
        runner.main(name, argv)
