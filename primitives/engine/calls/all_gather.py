"""The checked all_gather: argument checks, the check round, the ledger and "auto" around the
textbook algorithms of primitives/all_gather.py (which run unchanged on every transport).

    torchrun --nproc_per_node 4 primitives/allgather.py
"""
from __future__ import annotations

from primitives.all_gather import direct, linear, ring
from primitives.engine import shm_collectives
from primitives.engine.check import Check
from primitives.engine.core import PASSED, flat_work, plan, remember, replayed, run, sig
from primitives.engine.envelope import Fused
from primitives.engine.hierarchical import all_gather_2level


ALGOS = {"linear": linear, "ring": ring, "direct": direct,
         "hierarchical": all_gather_2level,               # multinode: hierarchical.py
         "shm": shm_collectives.all_gather}               # shm transport only


def _run(name, blocks, tensor, comm, check, algorithm, ok, async_op, post=None, tag=0, rp=None, key=None):
    nbytes = tensor.numel() * tensor.element_size() * comm.size if ok else 0   # S: the full output
    pl = rp.plan if rp is not None else plan(name, algorithm, ALGOS, comm, nbytes, check)
    if rp is None:
        remember(comm, key, check, pl)
    algo = pl.algo

    st = {}

    def prep():                                  # at execution time (async calls run later)
        if not st:
            st["work"] = [flat_work(b) for b in blocks()]
            st["flat"] = [w for w, _ in st["work"]]
            st["src"] = flat_work(tensor)[0]
            if st["flat"][comm.rank].data_ptr() != st["src"].data_ptr():
                st["flat"][comm.rank].copy_(st["src"])
        return st["flat"], st["src"]

    def done():
        for orig, (w, copied) in zip(blocks(), st["work"]):
            if copied:
                orig.copy_(w.view_as(orig))
        if post is not None:
            post()

    def body():
        flat, src = prep()
        if src.numel() and comm.size > 1:
            ALGOS[algo](comm, flat)
        done()

    def finish(got):                             # fused: the blocks came in the check's envelopes
        flat, src = prep()
        nb = src.numel() * src.element_size()
        for p, g in got(nb, src.dtype).items():
            flat[p].copy_(g)
        done()
        return [nb] * (comm.size - 1)
    fused = (Fused(lambda peer: prep()[1], finish, same_for_all=True)
             if ok and tensor.numel() and pl.fused else None)
    return run(comm, name, algo, check, plan=pl, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=None, root=-1,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               fused=fused, replay=rp)


def all_gather(comm, tensor_list, tensor, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather(tensor_list, tensor): tensor_list[i] <- rank i's tensor."""
    rp, key = replayed(comm, "all_gather", sig(tensor_list), sig(tensor), algorithm, tag)
    check, ok = (PASSED, True) if rp is not None else (Check(comm, "all_gather"), None)
    if rp is None:
        ok = check.tensor("tensor", tensor) and check.tensor_list("tensor_list", tensor_list, tensor)
    return _run("all_gather", lambda: tensor_list, tensor, comm, check, algorithm, ok, async_op, tag=tag,
                rp=rp, key=key)


def all_gather_single(comm, output, input, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather_single: output (N·numel elements) <- all inputs, rank-major."""
    rp, key = replayed(comm, "all_gather_single", sig(output), sig(input), algorithm, tag)
    check = PASSED if rp is not None else Check(comm, "all_gather_single")
    ok = rp is not None or (check.tensor("input", input) and check.tensor("output", output))
    if rp is None and ok and output.dtype != input.dtype:
        check.fail(f"argument 'output' has dtype {output.dtype}, expected {input.dtype} like 'input'")
        ok = False
    if rp is None and ok:
        check.sizes(f"argument 'output' must hold world_size({comm.size}) × input.numel()({input.numel()})",
                    output.numel(), comm.size * input.numel())
        ok = not check.errors
    out = output if not ok or output.is_contiguous() else output.contiguous()
    blocks = lambda: list(out.view(-1).tensor_split(comm.size))  # noqa: E731
    post = None if out is output else (lambda: output.copy_(out))
    return _run("all_gather_single", blocks, input, comm, check, algorithm, ok, async_op, post, tag=tag,
                rp=rp, key=key)
