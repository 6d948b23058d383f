"""The checked scatter: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/scatter.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/run.py scatter
"""
from __future__ import annotations

from primitives.engine.check import Check
from primitives.engine.core import flat_work, plan, run
from primitives.scatter import linear, ring, tree


ALGOS = {"linear": linear, "ring": ring, "tree": tree}


def scatter(comm, tensor, scatter_list=None, src=0, async_op=False, *, group_src=None, algorithm="auto",
            tag=0):
    """Like torch.distributed.scatter(tensor, scatter_list, src); scatter_list is read on src only."""
    check = Check(comm, "scatter")
    ok = check.tensor("tensor", tensor)
    root = check.root("src", src, group_src)
    is_root = comm.rank == root
    ok = ok and not check.errors                 # a bad root already explains itself
    if ok and is_root:
        ok = check.tensor_list("scatter_list", scatter_list, tensor)
    elif ok and scatter_list not in (None, []):
        check.fail(f"argument 'scatter_list' must be None on ranks other than the root (group rank {root})")
        ok = False
    nbytes = tensor.numel() * tensor.element_size() * comm.size if ok else 0   # S: all N blocks
    pl = plan("scatter", algorithm, ALGOS, comm, nbytes, check)
    algo = pl.algo

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
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag)
