"""Alias of primitives/all_gather.py under the name the issue uses.

    torchrun --nproc_per_node 4 primitives/allgather.py
    mpiexec -n 4 python primitives/allgather.py --backend mpi
"""
if __name__ == "__main__":
    from primitives.engine.runner import main
    main("all_gather")
