"""The checked broadcast and reduce: argument checks, the check round, the ledger and "auto"
around the textbook algorithms of primitives/broadcast.py and reduce.py (which run unchanged on
every transport).

    torchrun --nproc_per_node 4 primitives/run.py broadcast
    torchrun --nproc_per_node 4 primitives/run.py reduce
"""
from __future__ import annotations

from primitives.broadcast import linear, ring, tree
from primitives.reduce import linear as r_linear, ring as r_ring, tree as r_tree
from primitives.engine.check import ReduceOp
from primitives.engine.core import LazyFlat, flat_work, run
from primitives.engine.envelope import Fused
from primitives.engine.planned import nbytes, prepare, sig
from primitives.ops import finish_avg_

ALGOS = {"linear": linear, "ring": ring, "tree": tree}
REDUCE_ALGOS = {"linear": r_linear, "ring": r_ring, "tree": r_tree}


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
