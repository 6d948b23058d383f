"""Chapter 5: torch's DistributedDataParallel on the same model, the reference implementation.

    torchrun --standalone --nproc_per_node 2 ddp_examples/05_torch_ddp.py

(torchrun only: torch wheels have no MPI backend.) Cost per step and rank: gloo's own ring
all-reduce, 2(N−1)/N·Ψ·4 bytes, not visible to our ledger.
"""
from torch.nn.parallel import DistributedDataParallel

from ddp_examples.engine.common import main


def wrap(model, cfg):
    return DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)


if __name__ == "__main__":
    main(wrap, "chapter 5: torch DistributedDataParallel", needs_torch_dist=True)
