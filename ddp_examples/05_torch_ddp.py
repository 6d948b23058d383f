"""Chapter 5: torch's DistributedDataParallel on the same model, the reference implementation.

    torchrun --standalone --nproc_per_node 2 ddp_examples/05_torch_ddp.py

(torchrun only: torch wheels have no MPI backend.) Cost per step and rank: gloo's own ring
all-reduce, 2(N−1)/N·Ψ·4 bytes, not visible to our ledger.
"""
if __name__ == "__main__":  # run by path: import this checkout, not another installed one
    import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch.nn.parallel import DistributedDataParallel

from ddp_examples.common import main


def wrap(model, cfg):
    return DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)


if __name__ == "__main__":
    main(wrap, "chapter 5: torch DistributedDataParallel", needs_torch_dist=True)
