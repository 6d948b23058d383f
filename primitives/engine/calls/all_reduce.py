"""The checked all_reduce: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/all_reduce.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/allreduce.py
"""
from __future__ import annotations

from primitives.all_reduce import direct, linear, one_shot, rabenseifner, recursive_doubling, reduce_rows, ring
from primitives.engine import planned, shm_collectives
from primitives.engine.check import ReduceOp
from primitives.engine.core import LazyFlat, _pending, run
from primitives.engine.envelope import Fused
from primitives.engine.subcomm import all_reduce_2level
from primitives.engine.planned import fingerprint, nbytes, prepare, sig
from primitives.ops import finish_avg_

ALGOS = {"linear": linear, "ring": ring, "direct": direct, "one_shot": one_shot,
         "recursive_doubling": recursive_doubling, "rabenseifner": rabenseifner,
         "hierarchical": all_reduce_2level,               # multinode: subcomm.py
         "shm": shm_collectives.all_reduce}               # shm transport only


def all_reduce(comm, tensor, op=ReduceOp.SUM, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_reduce(tensor, op): in place on every rank of comm. A call whose
    dtype, shape, device, layout, op, algorithm and tag match a call that passed the argument
    check replays that call's plan (core.Replay) without checking them again; a blocking call of
    a signature whose ledger record is known runs its Planned (planned.py): the textbook function."""
    if not async_op and (pl := comm.__dict__.get("planned")):
        if (pl := pl.get((tensor.dtype, tensor.shape, id(op), algorithm, tag))) is not None and pl.run(tensor):
            return None

    def validate(check):
        ok = check.tensor("tensor", tensor)
        return ok, check.op(op, tensor.dtype if ok else None)
    rp, pl, check, ok, opn, S = prepare(comm, "all_reduce", algorithm, ALGOS, (sig(tensor), op, algorithm, tag),
                                        validate, lambda _: nbytes(tensor))
    n, prep = comm.size, LazyFlat(tensor)

    def done():
        finish_avg_(prep(), opn, n)
        prep.copy_back()

    def body():
        buf = prep()
        if buf.numel() and n > 1:
            ALGOS[pl.algo](comm, buf, opn)
        done()

    def finish(got):                             # fused: one_shot, its messages carried by the check's envelopes
        buf = prep()
        rows = got(S, buf.dtype)
        rows[comm.rank] = buf
        reduce_rows(buf, [rows[p] for p in range(n)], opn)
        done()
        return [S] * (n - 1)
    out = run(comm, "all_reduce", check, pl, ok, tensor, body, async_op, tag, S, op=opn, replay=rp,
              fused=Fused(lambda peer: prep(), finish, same_for_all=True))
    if (rp is not None and rp.record is not None and pl.algo == "shm" and pl.check in ("shm", None) and not async_op
            and tensor.numel() and n > 1 and not prep._copied):   # nothing left to decide: planned.py
        stamp = shm_collectives.Stamp("all_reduce", fingerprint("all_reduce", pl.algo, opn, -1, tensor.dtype,
                                                                tensor.numel(), tuple(tensor.shape), tag), [])
        planned.all_reduce(comm, tensor, op, algorithm, tag, opn, stamp if pl.check else None, rp.record, _pending)
    return out
