"""Chapter 2: naive data parallelism, one all-reduce per parameter after backward.

    torchrun --standalone --nproc_per_node 2 ddp_examples/02_naive.py
    mpiexec -n 2 python ddp_examples/02_naive.py --backend mpi

Cost per step and rank: 2(N−1)/N·Ψ·4 bytes in 2(N−1) messages *per parameter tensor*.
The class, and a broken `type(param) is torch.Tensor` version, are in naive.py.
"""
from ddp_examples.engine.common import main
from ddp_examples.engine.wrappers import NaiveDataParallel


def wrap(model, cfg):
    return NaiveDataParallel(model, algorithm=cfg.algorithm)


if __name__ == "__main__":
    main(wrap, "chapter 2: naive data parallel")
