"""The checked reduce: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/reduce.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/run.py reduce
"""
from __future__ import annotations

from primitives.engine.check import Check, ReduceOp
from primitives.engine.core import PASSED, flat_work, plan, remember, replayed, run, sig
from primitives.ops import finish_avg_
from primitives.reduce import linear, ring, tree


ALGOS = {"linear": linear, "ring": ring, "tree": tree}


def reduce(comm, tensor, dst, op=None, async_op=False, *, group_dst=None, algorithm="auto",
           tag=0):
    """Like torch.distributed.reduce(tensor, dst, op): the result lands in dst's tensor."""
    op = ReduceOp.SUM if op is None else op
    rp, key = replayed(comm, "reduce", sig(tensor), dst, group_dst, op, algorithm, tag)
    if rp is not None:                           # a planned signature: no argument check (core.Replay)
        pl, (root, opn), check, ok = rp.plan, rp.args, PASSED, True
        nbytes = tensor.numel() * tensor.element_size()
    else:
        check = Check(comm, "reduce")
        ok = check.tensor("tensor", tensor)
        root = check.root("dst", dst, group_dst)
        opn = check.op(op, tensor.dtype if ok else None)
        nbytes = tensor.numel() * tensor.element_size() if ok else 0
        pl = plan("reduce", algorithm, ALGOS, comm, nbytes, check)
        remember(comm, key, check, pl, (root, opn))
    algo = pl.algo

    def body():
        buf, copied = flat_work(tensor)
        if buf.numel() and comm.size > 1:
            ALGOS[algo](comm, buf, root, opn)
        if comm.rank == root:
            finish_avg_(buf, opn, comm.size)
            if copied:
                tensor.copy_(buf.view_as(tensor))
    return run(comm, "reduce", algo, check, plan=pl, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=opn, root=root,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               replay=rp)
