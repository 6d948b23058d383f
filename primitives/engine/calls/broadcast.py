"""The checked broadcast: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/broadcast.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/run.py broadcast
"""
from __future__ import annotations

from primitives.broadcast import linear, ring, tree
from primitives.engine.check import Check
from primitives.engine.core import PASSED, LazyFlat, plan, remember, replayed, run, sig
from primitives.engine.envelope import Fused


ALGOS = {"linear": linear, "ring": ring, "tree": tree}


def broadcast(comm, tensor, src, async_op=False, *, group_src=None, algorithm="auto",
              tag=0):
    """Like torch.distributed.broadcast: tensor on every rank becomes src's tensor (src is a global rank)."""
    rp, key = replayed(comm, "broadcast", sig(tensor), src, group_src, algorithm, tag)
    if rp is not None:                           # a planned signature: no argument check (core.Replay)
        pl, root, check, ok, nbytes = rp.plan, rp.args, PASSED, True, tensor.numel() * tensor.element_size()
    else:
        check = Check(comm, "broadcast")
        ok = check.tensor("tensor", tensor)
        root = check.root("src", src, group_src)
        nbytes = tensor.numel() * tensor.element_size() if ok else 0
        pl = plan("broadcast", algorithm, ALGOS, comm, nbytes, check)
        remember(comm, key, check, pl, root)
    algo = pl.algo

    prep = LazyFlat(tensor)
    done = prep.copy_back

    def body():
        buf = prep()
        if buf.numel() and comm.size > 1:
            ALGOS[algo](comm, buf, root)
        done()

    def finish(got):                             # fused: the root's data came in its envelope
        buf = prep()
        nb = buf.numel() * buf.element_size()
        if comm.rank != root:
            buf.copy_(got(nb, buf.dtype)[root])
            done()
        return {root: nb} if comm.rank != root else {}    # by peer: only the root sent data
    fused = (Fused(lambda peer: prep() if comm.rank == root else None, finish, same_for_all=True)
             if ok and tensor.numel() and pl.fused else None)
    return run(comm, "broadcast", algo, check, plan=pl, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=None, root=root,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               fused=fused, replay=rp)
