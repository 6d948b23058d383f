"""Chapter 4: buckets all-reduced asynchronously while backward goes on; no_sync for accumulation.

    torchrun --standalone --nproc_per_node 2 ddp_examples/04_bucketed.py --bucket-cap-mb 0.004
    torchrun --standalone --nproc_per_node 3 ddp_examples/04_bucketed.py --accum 2
    mpiexec -n 2 python ddp_examples/04_bucketed.py --backend mpi

Cost per step and rank: 2(N−1)/N·Ψ·4 bytes in 2(N−1)·(buckets) messages, mostly hidden behind
backward. The class is in bucketed.py (0.004 MB buckets split the small model into 4 buckets).
"""
from ddp_examples.engine.common import main
from ddp_examples.engine.wrappers import BucketedDataParallel


def wrap(model, cfg):
    return BucketedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, algorithm=cfg.algorithm)


if __name__ == "__main__":
    main(wrap, "chapter 4: bucketed + overlapped")
