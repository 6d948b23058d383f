"""Chapter 3: one all-reduce over one flat gradient buffer (every .grad is a view into it).

    torchrun --standalone --nproc_per_node 2 ddp_examples/03_flat.py
    mpiexec -n 2 python ddp_examples/03_flat.py --backend mpi

Cost per step and rank: 2(N−1)/N·Ψ·4 bytes in 2(N−1) messages. The class is in flat.py.
"""
from ddp_examples.engine.common import main
from ddp_examples.engine.wrappers import FlatDataParallel


def wrap(model, cfg):
    return FlatDataParallel(model, algorithm=cfg.algorithm)


if __name__ == "__main__":
    main(wrap, "chapter 3: flat buffer")
