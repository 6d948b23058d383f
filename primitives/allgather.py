"""Run, verify and time every all-gather algorithm against the backend's own (runner.py).

    torchrun --nproc_per_node 4 primitives/allgather.py
    mpiexec -n 4 python primitives/allgather.py --backend mpi

The algorithms: primitives/all_gather.py.
"""
from primitives.engine.runner import main

if __name__ == "__main__":
    main("all_gather")
