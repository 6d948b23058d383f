"""The checked rooted collectives, broadcast, reduce, gather and scatter: argument checks, the
check round, the ledger and "auto" around the textbook algorithms of primitives/broadcast.py,
reduce.py, gather.py and scatter.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/run.py broadcast      (reduce, gather, scatter)
"""
from __future__ import annotations

from primitives.broadcast import linear, ring, tree
from primitives.gather import linear as g_linear, ring as g_ring, tree as g_tree
from primitives.reduce import linear as r_linear, ring as r_ring, tree as r_tree
from primitives.scatter import linear as s_linear, ring as s_ring, tree as s_tree
from primitives.engine.check import ReduceOp
from primitives.engine.core import LazyFlat, flat_work, run
from primitives.engine.envelope import Fused
from primitives.engine.planned import nbytes, prepare, sig
from primitives.ops import finish_avg_

ALGOS = {"linear": linear, "ring": ring, "tree": tree}
REDUCE_ALGOS = {"linear": r_linear, "ring": r_ring, "tree": r_tree}
GATHER_ALGOS = {"linear": g_linear, "ring": g_ring, "tree": g_tree}
SCATTER_ALGOS = {"linear": s_linear, "ring": s_ring, "tree": s_tree}


def broadcast(comm, tensor, src, async_op=False, *, group_src=None, algorithm="auto", tag=0):
    """Like torch.distributed.broadcast: tensor on every rank becomes src's tensor (src is a global rank)."""
    rp, pl, check, ok, root, S = prepare(
        comm, "broadcast", algorithm, ALGOS, (sig(tensor), src, group_src, algorithm, tag),
        lambda check: (check.tensor("tensor", tensor), check.root("src", src, group_src)), lambda _: nbytes(tensor))
    prep = LazyFlat(tensor)

    def body():
        buf = prep()
        if buf.numel() and comm.size > 1:
            ALGOS[pl.algo](comm, buf, root)
        prep.copy_back()

    def finish(got):                             # fused: the root's data came in its envelope
        if comm.rank == root:
            return {}                            # by peer: only the root sent data
        buf = prep()
        buf.copy_(got(S, buf.dtype)[root])
        prep.copy_back()
        return {root: S}
    return run(comm, "broadcast", check, pl, ok, tensor, body, async_op, tag, S, root=root, replay=rp,
               fused=Fused(lambda peer: prep() if comm.rank == root else None, finish, same_for_all=True))


def reduce(comm, tensor, dst, op=None, async_op=False, *, group_dst=None, algorithm="auto", tag=0):
    """Like torch.distributed.reduce(tensor, dst, op): the result lands in dst's tensor."""
    op = ReduceOp.SUM if op is None else op

    def validate(check):
        ok = check.tensor("tensor", tensor)
        return ok, (check.root("dst", dst, group_dst), check.op(op, tensor.dtype if ok else None))
    rp, pl, check, ok, (root, opn), S = prepare(comm, "reduce", algorithm, REDUCE_ALGOS,
                                                (sig(tensor), dst, group_dst, op, algorithm, tag),
                                                validate, lambda _: nbytes(tensor))

    def body():
        buf, copied = flat_work(tensor)
        if buf.numel() and comm.size > 1:
            REDUCE_ALGOS[pl.algo](comm, buf, root, opn)
        if comm.rank == root:
            finish_avg_(buf, opn, comm.size)
            if copied:
                tensor.copy_(buf.view_as(tensor))
    return run(comm, "reduce", check, pl, ok, tensor, body, async_op, tag, S, op=opn, root=root, replay=rp)


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
    rp, pl, check, ok, root, S = rooted(comm, "gather", GATHER_ALGOS, tensor, gather_list, "dst", dst, group_dst,
                                        algorithm, tag)
    is_root = comm.rank == root

    def body():
        mine, _ = flat_work(tensor)
        work = [flat_work(b) for b in gather_list] if is_root else None
        blocks = [w for w, _ in work] if is_root else None
        if comm.size == 1:
            blocks[0].copy_(mine)
        elif mine.numel():
            GATHER_ALGOS[pl.algo](comm, mine, blocks, root)
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
