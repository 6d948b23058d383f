"""The checked gather: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/gather.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/run.py gather
"""
from __future__ import annotations

from primitives.engine.check import Check
from primitives.engine.core import flat_work, plan, run
from primitives.gather import linear, ring, tree


ALGOS = {"linear": linear, "ring": ring, "tree": tree}


def gather(comm, tensor, gather_list=None, dst=0, async_op=False, *, group_dst=None, algorithm="auto",
           tag=0):
    """Like torch.distributed.gather(tensor, gather_list, dst); gather_list is written on dst only."""
    check = Check(comm, "gather")
    ok = check.tensor("tensor", tensor)
    root = check.root("dst", dst, group_dst)
    is_root = comm.rank == root
    ok = ok and not check.errors                 # a bad root already explains itself
    if ok and is_root:
        ok = check.tensor_list("gather_list", gather_list, tensor)
    elif ok and gather_list not in (None, []):
        check.fail(f"argument 'gather_list' must be None on ranks other than the root (group rank {root})")
        ok = False
    nbytes = tensor.numel() * tensor.element_size() * comm.size if ok else 0   # S: all N blocks
    pl = plan("gather", algorithm, ALGOS, comm, nbytes, check)
    algo = pl.algo

    def body():
        mine, _ = flat_work(tensor)
        work = [flat_work(b) for b in gather_list] if is_root else None
        blocks = [w for w, _ in work] if is_root else None
        if comm.size == 1:
            blocks[0].copy_(mine)
        elif mine.numel():
            ALGOS[algo](comm, mine, blocks, root)
        if is_root:
            for orig, (w, copied) in zip(gather_list, work):
                if copied:
                    orig.copy_(w.view_as(orig))
    return run(comm, "gather", algo, check, plan=pl, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=None, root=root,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag)
