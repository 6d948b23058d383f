"""The checked all_gather and reduce_scatter (list and single forms): argument checks, the check
round, the ledger and "auto" around the textbook algorithms of primitives/all_gather.py and
reduce_scatter.py (which run unchanged on every transport). Each works on N blocks, one per rank.

    torchrun --nproc_per_node 4 primitives/allgather.py
    torchrun --nproc_per_node 4 primitives/reducescatter.py
"""
from __future__ import annotations

import torch

from primitives.all_gather import direct, linear, ring
from primitives.reduce_scatter import direct as rs_direct, linear as rs_linear, ring as rs_ring
from primitives.engine import shm_collectives
from primitives.engine.check import ReduceOp
from primitives.engine.core import LazyFlat, flat_work, run
from primitives.engine.envelope import Fused
from primitives.engine.subcomm import all_gather_2level, reduce_scatter_2level
from primitives.engine.planned import nbytes, prepare, sig
from primitives.ops import combine_, finish_avg_

ALGOS = {"linear": linear, "ring": ring, "direct": direct,
         "hierarchical": all_gather_2level,               # multinode: subcomm.py
         "shm": shm_collectives.all_gather}               # shm transport only
RS_ALGOS = {"linear": rs_linear, "ring": rs_ring, "direct": rs_direct,
            "hierarchical": reduce_scatter_2level,
            "shm": shm_collectives.reduce_scatter}


class _Blocks:
    """The call's N blocks (blocks(): block p is rank p's) and its own tensor `mine`, each a
    core.LazyFlat (made when the call executes); done() writes back the blocks' or mine's copies,
    then runs post()."""

    def __init__(self, blocks, mine, post=None):
        self.blocks, self.mine, self.post, self.lazy = blocks, LazyFlat(mine), post, None

    def __call__(self):
        if self.lazy is None:
            self.lazy = [LazyFlat(b) for b in self.blocks()]
            self.flat = [b() for b in self.lazy]
        return self.flat, self.mine()

    def done(self, into_blocks: bool):
        for b in self.lazy if into_blocks else [self.mine]:
            b.copy_back()
        if self.post is not None:
            self.post()


def _all_gather(name, comm, key, validate, blocks, tensor, async_op, algorithm, tag, post=None):
    rp, pl, check, ok, _, S = prepare(comm, name, algorithm, ALGOS, key, validate,
                                      lambda _: nbytes(tensor) * comm.size)        # S: the full output
    st = _Blocks(blocks, tensor, post)

    def prep():
        flat, src = st()
        if flat[comm.rank].data_ptr() != src.data_ptr():
            flat[comm.rank].copy_(src)
        return flat, src

    def body():
        flat, src = prep()
        if src.numel() and comm.size > 1:
            ALGOS[pl.algo](comm, flat)
        st.done(True)

    def finish(got):                             # fused: the blocks came in the check's envelopes
        flat, src = prep()
        nb = nbytes(src)
        for p, g in got(nb, src.dtype).items():
            flat[p].copy_(g)
        st.done(True)
        return [nb] * (comm.size - 1)
    return run(comm, name, check, pl, ok, tensor, body, async_op, tag, S, replay=rp,
               fused=Fused(lambda peer: prep()[1], finish, same_for_all=True))


def all_gather(comm, tensor_list, tensor, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather(tensor_list, tensor): tensor_list[i] <- rank i's tensor."""
    return _all_gather("all_gather", comm, (sig(tensor_list), sig(tensor), algorithm, tag),
                       lambda check: (check.tensor("tensor", tensor)
                                      and check.tensor_list("tensor_list", tensor_list, tensor), None),
                       lambda: tensor_list, tensor, async_op, algorithm, tag)


def _blocks_of(check, comm, small, big, s: str, b: str) -> bool:
    """The single forms' check: `big` (argument b) holds N blocks the size of `small` (argument s),
    of its dtype."""
    if not (check.tensor(s, small) and check.tensor(b, big)):
        return False
    if big.dtype != small.dtype:
        check.fail(f"argument {b!r} has dtype {big.dtype}, expected {small.dtype} like {s!r}")
        return False
    check.sizes(f"argument {b!r} must hold world_size({comm.size}) × {s}.numel()({small.numel()})",
                big.numel(), comm.size * small.numel())
    return not check.errors


def all_gather_single(comm, output, input, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather_single: output (N·numel elements) <- all inputs, rank-major."""
    strided = isinstance(output, torch.Tensor) and output.layout == torch.strided
    out = output.contiguous() if strided else output         # the blocks: views of one contiguous buffer
    return _all_gather("all_gather_single", comm, (sig(output), sig(input), algorithm, tag),
                       lambda check: (_blocks_of(check, comm, input, output, "input", "output"), None),
                       lambda: list(out.view(-1).tensor_split(comm.size)), input, async_op, algorithm, tag,
                       post=None if out is output else (lambda: output.copy_(out)))


def _reduce_scatter(name, comm, key, validate, blocks, output, async_op, algorithm, tag):
    """validate(check) -> (ok, (op name, sizes)); sizes: the numel of every block when they differ
    (torch's uneven reduce_scatter list); then only "direct" runs them (each rank receives just its
    own block's size from every peer)."""
    n = comm.size
    rp, pl, check, ok, (opn, sizes), S = prepare(
        comm, name, lambda a: "direct" if a[1] else algorithm, RS_ALGOS, key, validate,
        lambda a: (sum(a[1]) if a[1] else output.numel() * n) * output.element_size())
    st = _Blocks(blocks, output)

    def body():
        flat, out = st()
        if n == 1 or out.numel() == 0:
            out.copy_(flat[comm.rank])
        else:
            RS_ALGOS[pl.algo](comm, flat, out, opn)
        finish_avg_(out, opn, n)
        st.done(False)

    def finish(got):                             # fused: each rank's block r came in its envelope
        flat, out = st()
        nb = nbytes(out)
        rows = got(nb, out.dtype)
        rows[comm.rank] = flat[comm.rank]
        acc = rows[0].clone()                    # rank order: deterministic; out may alias my block
        for p in range(1, n):
            combine_(acc, rows[p], opn)
        out.copy_(acc)
        finish_avg_(out, opn, n)
        st.done(False)
        return [nb] * (n - 1)
    return run(comm, name, check, pl, ok, output, body, async_op, tag, S, op=opn, replay=rp,
               fused=None if sizes else Fused(lambda peer: st()[0][peer], finish, same_for_all=False),
               numel=sum(sizes) if sizes else None, shape=tuple(sizes) if sizes else None)


def _input_list(check, comm, lst, output, algorithm) -> tuple[bool, list | None]:
    """(ok, sizes): a list of N tensors of output's dtype, block `rank` the size of output;
    sizes lists every block's numel when they are uneven (None when all match output)."""
    n = comm.size
    if not isinstance(lst, (list, tuple)) or len(lst) != n:
        got = f"length {len(lst)}" if isinstance(lst, (list, tuple)) else type(lst).__name__
        check.fail(f"argument 'input_list' must be a list of {n} tensors (one per rank), got {got}")
        return False, None
    if not all(check.tensor(f"input_list[{i}]", t) for i, t in enumerate(lst)):
        return False, None
    bad = [i for i, t in enumerate(lst) if t.dtype != output.dtype]
    if bad:
        check.fail(f"argument input_list{bad} differ in dtype from 'output' ({output.dtype})")
        return False, None
    if lst[comm.rank].numel() != output.numel():
        check.fail(f"argument input_list[{comm.rank}] has {lst[comm.rank].numel()} elements but 'output' has "
                   f"{output.numel()}: this rank's block must fill its output")
        return False, None
    sizes = [t.numel() for t in lst]
    if len(set(sizes)) == 1:
        return True, None
    if algorithm not in ("auto", "direct"):
        check.fail(f"argument 'input_list' holds blocks of different sizes {sizes}; algorithm "
                   f"{algorithm!r} needs equal blocks: use algorithm='direct' (or 'auto')")
    return True, sizes


def reduce_scatter(comm, output, input_list, op=ReduceOp.SUM, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter(output, input_list, op); input_list[p] may differ in
    size between blocks (block p the size of rank p's output), as on gloo."""
    def validate(check):
        ok, sizes = (_input_list(check, comm, input_list, output, algorithm) if check.tensor("output", output)
                     else (False, None))
        return ok, (check.op(op, output.dtype if ok else None), sizes)
    return _reduce_scatter("reduce_scatter", comm, (sig(output), sig(input_list), op, algorithm, tag), validate,
                           lambda: input_list, output, async_op, algorithm, tag)


def reduce_scatter_single(comm, output, input, op=ReduceOp.SUM, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter_single: input holds N blocks of output.numel() elements."""
    def validate(check):
        ok = _blocks_of(check, comm, output, input, "output", "input")
        return ok, (check.op(op, output.dtype if ok else None), None)
    return _reduce_scatter("reduce_scatter_single", comm, (sig(output), sig(input), op, algorithm, tag), validate,
                           lambda: list(flat_work(input)[0].tensor_split(comm.size)), output, async_op,
                           algorithm, tag)
