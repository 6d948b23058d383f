"""The checked gather and scatter: argument checks, the check round, the ledger and "auto" around
the textbook algorithms of primitives/gather.py and scatter.py (which run unchanged on every
transport).

    torchrun --nproc_per_node 4 primitives/run.py gather
    torchrun --nproc_per_node 4 primitives/run.py scatter
"""
from __future__ import annotations

from primitives.gather import linear, ring, tree
from primitives.scatter import linear as s_linear, ring as s_ring, tree as s_tree
from primitives.engine.core import flat_work, run
from primitives.engine.planned import nbytes, prepare, sig

ALGOS = {"linear": linear, "ring": ring, "tree": tree}
SCATTER_ALGOS = {"linear": s_linear, "ring": s_ring, "tree": s_tree}


def rooted(comm, name, algos, tensor, lst, arg, value, group_value, algorithm, tag):
    """The argument check of gather and scatter (a tensor everywhere, a list of N on the root
    only; `arg` names the root), or a planned signature's Replay: (replay, plan, check, ok, root,
    S) with S all N blocks."""
    def validate(check):
        ok = check.tensor("tensor", tensor)
        root = check.root(arg, value, group_value)
        ok = ok and not check.errors                 # a bad root already explains itself
        if ok and comm.rank == root:
            ok = check.tensor_list(f"{name}_list", lst, tensor)
        elif ok and lst not in (None, []):
            check.fail(f"argument '{name}_list' must be None on ranks other than the root (group rank {root})")
        return ok, root
    return prepare(comm, name, algorithm, algos, (sig(tensor), sig(lst), value, group_value, algorithm, tag),
                   validate, lambda _: nbytes(tensor) * comm.size)


def gather(comm, tensor, gather_list=None, dst=0, async_op=False, *, group_dst=None, algorithm="auto",
           tag=0):
    """Like torch.distributed.gather(tensor, gather_list, dst); gather_list is written on dst only."""
    rp, pl, check, ok, root, S = rooted(comm, "gather", ALGOS, tensor, gather_list, "dst", dst, group_dst,
                                        algorithm, tag)
    is_root = comm.rank == root

    def body():
        mine, _ = flat_work(tensor)
        work = [flat_work(b) for b in gather_list] if is_root else None
        blocks = [w for w, _ in work] if is_root else None
        if comm.size == 1:
            blocks[0].copy_(mine)
        elif mine.numel():
            ALGOS[pl.algo](comm, mine, blocks, root)
        for orig, (w, copied) in zip(gather_list, work) if is_root else ():
            if copied:
                orig.copy_(w.view_as(orig))
    return run(comm, "gather", check, pl, ok, tensor, body, async_op, tag, S, root=root, replay=rp)


def scatter(comm, tensor, scatter_list=None, src=0, async_op=False, *, group_src=None, algorithm="auto",
            tag=0):
    """Like torch.distributed.scatter(tensor, scatter_list, src); scatter_list is read on src only."""
    rp, pl, check, ok, root, S = rooted(comm, "scatter", SCATTER_ALGOS, tensor, scatter_list, "src", src,
                                        group_src, algorithm, tag)
    is_root = comm.rank == root

    def body():
        out, copied = flat_work(tensor)
        blocks = [flat_work(b)[0] for b in scatter_list] if is_root else None
        if comm.size == 1:
            out.copy_(blocks[0])
        elif out.numel():
            SCATTER_ALGOS[pl.algo](comm, out, blocks, root)
        if copied:
            tensor.copy_(out.view_as(tensor))
    return run(comm, "scatter", check, pl, ok, tensor, body, async_op, tag, S, root=root, replay=rp)
