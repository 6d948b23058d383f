"""Alias of primitives/reduce_scatter.py under the name the issue uses.

    torchrun --nproc_per_node 4 primitives/reducescatter.py
    mpiexec -n 4 python primitives/reducescatter.py --backend mpi
"""
if __name__ == "__main__":
    from primitives.engine.runner import main
    main("reduce_scatter")
