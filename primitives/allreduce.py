"""Run, verify and time every all-reduce algorithm against the backend's own (runner.py).

    torchrun --nproc_per_node 4 primitives/allreduce.py [--size 1048576] [--iters 5]
    mpiexec -n 4 python primitives/allreduce.py --backend mpi

The algorithms: primitives/all_reduce.py.
"""
from primitives.engine.runner import main

if __name__ == "__main__":
    main("all_reduce")
