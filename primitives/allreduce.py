"""Alias of primitives/all_reduce.py under the name the issue uses.

    torchrun --nproc_per_node 4 primitives/allreduce.py
    mpiexec -n 4 python primitives/allreduce.py --backend mpi
"""
if __name__ == "__main__":
    from primitives.engine.runner import main
    main("all_reduce")
