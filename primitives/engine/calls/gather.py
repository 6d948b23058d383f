"""The checked gather: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/gather.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/run.py gather
"""
from __future__ import annotations

from primitives.engine.check import Check
from primitives.engine.core import PASSED, flat_work, plan, remember, replayed, run, sig
from primitives.gather import linear, ring, tree


ALGOS = {"linear": linear, "ring": ring, "tree": tree}


def rooted(comm, name, algos, tensor, lst, arg, value, group_value, algorithm, tag):
    """The argument check of gather and scatter (a tensor everywhere, a list of N on the root
    only; `arg` names the root), or a planned signature's Replay: (replay, plan, root, check,
    ok, S) with S all N blocks."""
    rp, key = replayed(comm, name, sig(tensor), sig(lst), value, group_value, algorithm, tag)
    if rp is not None:
        return rp, rp.plan, rp.args, PASSED, True, tensor.numel() * tensor.element_size() * comm.size
    check = Check(comm, name)
    ok = check.tensor("tensor", tensor)
    root = check.root(arg, value, group_value)
    ok = ok and not check.errors                 # a bad root already explains itself
    if ok and comm.rank == root:
        ok = check.tensor_list(f"{name}_list", lst, tensor)
    elif ok and lst not in (None, []):
        check.fail(f"argument '{name}_list' must be None on ranks other than the root (group rank {root})")
        ok = False
    nbytes = tensor.numel() * tensor.element_size() * comm.size if ok else 0
    pl = plan(name, algorithm, algos, comm, nbytes, check)
    remember(comm, key, check, pl, root)
    return None, pl, root, check, ok, nbytes


def gather(comm, tensor, gather_list=None, dst=0, async_op=False, *, group_dst=None, algorithm="auto",
           tag=0):
    """Like torch.distributed.gather(tensor, gather_list, dst); gather_list is written on dst only."""
    rp, pl, root, check, ok, nbytes = rooted(comm, "gather", ALGOS, tensor, gather_list, "dst", dst, group_dst,
                                             algorithm, tag)
    algo, is_root = pl.algo, comm.rank == root

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
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               replay=rp)
