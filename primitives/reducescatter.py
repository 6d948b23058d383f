"""Run, verify and time every reduce-scatter algorithm against the backend's own (runner.py).

    torchrun --nproc_per_node 4 primitives/reducescatter.py
    mpiexec -n 4 python primitives/reducescatter.py --backend mpi

The algorithms: primitives/reduce_scatter.py.
"""
from primitives.engine.runner import main

if __name__ == "__main__":
    main("reduce_scatter")
