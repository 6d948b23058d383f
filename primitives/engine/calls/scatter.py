"""The checked scatter: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/scatter.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/run.py scatter
"""
from __future__ import annotations

from primitives.engine.calls.gather import rooted
from primitives.engine.core import flat_work, run
from primitives.scatter import linear, ring, tree


ALGOS = {"linear": linear, "ring": ring, "tree": tree}


def scatter(comm, tensor, scatter_list=None, src=0, async_op=False, *, group_src=None, algorithm="auto",
            tag=0):
    """Like torch.distributed.scatter(tensor, scatter_list, src); scatter_list is read on src only."""
    rp, pl, root, check, ok, nbytes = rooted(comm, "scatter", ALGOS, tensor, scatter_list, "src", src, group_src,
                                             algorithm, tag)
    algo, is_root = pl.algo, comm.rank == root

    def body():
        out, copied = flat_work(tensor)
        blocks = [flat_work(b)[0] for b in scatter_list] if is_root else None
        if comm.size == 1:
            out.copy_(blocks[0])
        elif out.numel():
            ALGOS[algo](comm, out, blocks, root)
        if copied:
            tensor.copy_(out.view_as(tensor))
    return run(comm, "scatter", algo, check, plan=pl, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=None, root=root,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               replay=rp)
