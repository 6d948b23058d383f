"""The checked reduce_scatter: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/reduce_scatter.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/reducescatter.py
"""
from __future__ import annotations

from primitives.engine import shm_collectives
from primitives.engine.check import Check, ReduceOp
from primitives.engine.core import PASSED, flat_work, plan, remember, replayed, run, sig
from primitives.engine.envelope import Fused
from primitives.engine.hierarchical import reduce_scatter_2level
from primitives.ops import combine_, finish_avg_
from primitives.reduce_scatter import direct, linear, ring


ALGOS = {"linear": linear, "ring": ring, "direct": direct,
         "hierarchical": reduce_scatter_2level,           # multinode: hierarchical.py
         "shm": shm_collectives.reduce_scatter}           # shm transport only


def _run(name, blocks, output, comm, check, opn, algorithm, ok, async_op, tag=0, sizes=None, rp=None, key=None):
    """sizes: the numel of every block when they differ (torch's uneven reduce_scatter list);
    then only "direct" runs them (each rank receives just its own block's size from every peer)."""
    nbytes = output.numel() * output.element_size() * comm.size if ok else 0
    if sizes:
        nbytes = sum(sizes) * output.element_size()      # S: the same on every rank
        if algorithm not in ("auto", "direct"):
            check.fail(f"argument 'input_list' holds blocks of different sizes {sizes}; algorithm "
                       f"{algorithm!r} needs equal blocks: use algorithm='direct' (or 'auto')")
        algorithm = "direct"
    pl = rp.plan if rp is not None else plan(name, algorithm, ALGOS, comm, nbytes, check)
    if rp is None:
        remember(comm, key, check, pl, (opn, sizes))
    algo = pl.algo

    st = {}

    def prep():                                  # at execution time (async calls run later)
        if not st:
            st["out"], st["copied"] = flat_work(output)
            st["flat"] = [flat_work(b)[0] for b in blocks()]
        return st["out"], st["flat"]

    def done():
        out = st["out"]
        finish_avg_(out, opn, comm.size)
        if st["copied"]:
            output.copy_(out.view_as(output))

    def body():
        out, flat = prep()
        if comm.size == 1 or out.numel() == 0:
            out.copy_(flat[comm.rank])
        else:
            ALGOS[algo](comm, flat, out, opn)
        done()

    def finish(got):                             # fused: each rank's block r came in its envelope
        out, flat = prep()
        nb = out.numel() * out.element_size()
        rows = got(nb, out.dtype)
        rows[comm.rank] = flat[comm.rank]
        acc = rows[0].clone()                    # rank order: deterministic; out may alias my block
        for p in range(1, comm.size):
            combine_(acc, rows[p], opn)
        out.copy_(acc)
        done()
        return [nb] * (comm.size - 1)
    fused = (Fused(lambda peer: prep()[1][peer], finish, same_for_all=False)
             if ok and output.numel() and not sizes and pl.fused else None)
    numel, shape = (sum(sizes), tuple(sizes)) if sizes else (output.numel(), tuple(output.shape))
    return run(comm, name, algo, check, plan=pl, numel=numel if ok else -1,
               dtype=output.dtype if ok else None, op=opn, root=-1,
               shape=shape if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               fused=fused, replay=rp)


def _input_list(check, comm, lst, output) -> tuple[bool, list | None]:
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
    return True, (sizes if len(set(sizes)) > 1 else None)


def reduce_scatter(comm, output, input_list, op=ReduceOp.SUM, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter(output, input_list, op); input_list[p] may differ in
    size between blocks (block p the size of rank p's output), as on gloo."""
    rp, key = replayed(comm, "reduce_scatter", sig(output), sig(input_list), op, algorithm, tag)
    if rp is not None:                           # a planned signature: no argument check (core.Replay)
        check, ok, (opn, sizes) = PASSED, True, rp.args
    else:
        check = Check(comm, "reduce_scatter")
        ok, sizes = _input_list(check, comm, input_list, output) if check.tensor("output", output) else (False, None)
        opn = check.op(op, output.dtype if ok else None)
    return _run("reduce_scatter", lambda: input_list, output, comm, check, opn, algorithm, ok, async_op, tag=tag,
                sizes=sizes, rp=rp, key=key)


def reduce_scatter_single(comm, output, input, op=ReduceOp.SUM, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter_single: input holds N blocks of output.numel() elements."""
    rp, key = replayed(comm, "reduce_scatter_single", sig(output), sig(input), op, algorithm, tag)
    check = PASSED if rp is not None else Check(comm, "reduce_scatter_single")
    ok = rp is not None or (check.tensor("output", output) and check.tensor("input", input))
    if rp is None and ok and output.dtype != input.dtype:
        check.fail(f"argument 'input' has dtype {input.dtype}, expected {output.dtype} like 'output'")
        ok = False
    if rp is None and ok:
        check.sizes(f"argument 'input' must hold world_size({comm.size}) × output.numel()({output.numel()})",
                    input.numel(), comm.size * output.numel())
        ok = not check.errors
    opn = rp.args[0] if rp is not None else check.op(op, output.dtype if ok else None)
    blocks = lambda: list(flat_work(input)[0].tensor_split(comm.size))  # noqa: E731
    return _run("reduce_scatter_single", blocks, output, comm, check, opn, algorithm, ok, async_op, tag=tag,
                rp=rp, key=key)
