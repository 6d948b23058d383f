"""Alias of primitives/all_reduce.py under the name the issue uses.

    torchrun --nproc_per_node 4 primitives/allreduce.py
    mpiexec -n 4 python primitives/allreduce.py --backend mpi
"""
if __name__ == "__main__":  # run by path: import this checkout, not another installed one
    import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":
    from primitives.runner import main
    main("all_reduce")
