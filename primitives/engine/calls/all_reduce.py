"""The checked all_reduce: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/all_reduce.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/allreduce.py
"""
from __future__ import annotations

from primitives.all_reduce import direct, linear, one_shot, rabenseifner, recursive_doubling, reduce_rows, ring
from primitives.engine import planned, shm_collectives
from primitives.engine.check import Check, ReduceOp
from primitives.engine.core import PASSED, LazyFlat, _pending, fingerprint, plan, remember, replayed, run, sig
from primitives.engine.envelope import Fused
from primitives.engine.hierarchical import all_reduce_2level
from primitives.ops import finish_avg_


def _one_shot_fused(prep, op, n, r, done):
    """The same algorithm, its messages carried by the check's envelopes (core.run)."""
    def finish(got):
        buf = prep()
        nb = buf.numel() * buf.element_size()
        rows = got(nb, buf.dtype)
        rows[r] = buf
        reduce_rows(buf, [rows[p] for p in range(n)], op)
        done()
        return [nb] * (n - 1)
    return Fused(lambda peer: prep(), finish, same_for_all=True)


ALGOS = {"linear": linear, "ring": ring, "direct": direct, "one_shot": one_shot,
         "recursive_doubling": recursive_doubling, "rabenseifner": rabenseifner,
         "hierarchical": all_reduce_2level,               # multinode: hierarchical.py
         "shm": shm_collectives.all_reduce}               # shm transport only


def all_reduce(comm, tensor, op=ReduceOp.SUM, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_reduce(tensor, op): in place on every rank of comm. A call whose
    dtype, shape, device, layout, op, algorithm and tag match a call that passed the argument
    check replays that call's plan (core.Replay) without checking them again; a blocking call of
    a signature whose ledger record is known runs its Planned (planned.py): the textbook function."""
    if not async_op and (pl := comm.__dict__.get("planned")):
        if (pl := pl.get((tensor.dtype, tensor.shape, id(op), algorithm, tag))) is not None and pl.run(tensor):
            return None
    rp, key = replayed(comm, "all_reduce", sig(tensor), op, algorithm, tag)
    if rp is not None:
        pl, opn, check, ok, nbytes = rp.plan, rp.args, PASSED, True, tensor.numel() * tensor.element_size()
    else:
        check = Check(comm, "all_reduce")
        ok = check.tensor("tensor", tensor)
        opn = check.op(op, tensor.dtype if ok else None)
        nbytes = tensor.numel() * tensor.element_size() if ok else 0
        pl = plan("all_reduce", algorithm, ALGOS, comm, nbytes, check)
        remember(comm, key, check, pl, opn)
    algo = pl.algo

    prep = LazyFlat(tensor)

    def done():
        finish_avg_(prep(), opn, comm.size)
        prep.copy_back()

    def body():
        buf = prep()
        if buf.numel() and comm.size > 1:
            ALGOS[algo](comm, buf, opn)
        done()
    fused = (_one_shot_fused(prep, opn, comm.size, comm.rank, done)
             if ok and tensor.numel() and pl.fused else None)
    out = run(comm, "all_reduce", algo, check, plan=pl, numel=tensor.numel() if ok else -1,
              dtype=tensor.dtype if ok else None, op=opn, root=-1,
              shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
              fused=fused, replay=rp)
    if (rp is not None and rp.record is not None and algo == "shm" and pl.check in ("shm", None) and not async_op
            and tensor.numel() and comm.size > 1 and not prep._copied):   # nothing left to decide: planned.py
        stamp = shm_collectives.Stamp("all_reduce", fingerprint("all_reduce", algo, opn, -1, tensor.dtype, tensor.numel(),
                                                                tuple(tensor.shape), tag), [])
        planned.all_reduce(comm, tensor, op, algorithm, tag, opn, stamp if pl.check else None, rp.record, _pending)
    return out
