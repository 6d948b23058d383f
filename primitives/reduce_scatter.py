"""Reduce-scatter from point-to-point: rank r ends with block r of the elementwise op over
every rank's N-block input.

    torchrun --nproc_per_node 4 primitives/reduce_scatter.py    (also: primitives/reducescatter.py)
    mpiexec -n 4 python primitives/reduce_scatter.py --backend mpi

Cost, S = bytes of one block (each input holds N·S):
  linear  reduce every whole input to rank 0, which sends each rank its block.
          Non-root ranks send N·S; rank 0 sends (N-1)·S.  (N-1)(α + NSβ + NSγ) + (N-1)(α + Sβ)
  ring    N-1 steps; at step s rank r adds its own block (r-s-2) to the partial sum it just
          received and passes it on. N-1 messages, (N-1)·S bytes per rank.
                                                           (N-1)(α + Sβ + Sγ)
  direct  one round: rank r sends block p to rank p and receives block r from everyone at
          once, then reduces the N contributions in rank order 0..N-1. N-1 messages,
          (N-1)·S bytes per rank; (N-1)·S bytes of scratch.  α + (N-1)·o + (N-1)S(β + γ)
  hierarchical  across m nodes × k ranks: intra rings per node, then an inter ring of the partial
          sums (primitives/engine/hierarchical.py); m(k-1)·S intra-node and (m-1)·S inter-node bytes per rank.
With the check on and a block ≤ 64 KiB, direct's blocks ride in the check's envelopes
(envelope.py): one round for check and data, what auto picks.
The caller's input is never modified (two block-sized scratch buffers, used in turn, so a
buffer is never overwritten while its send is in flight).
"""
from __future__ import annotations

from primitives.engine import shm_collectives
from primitives.reduce import _linear as _reduce_linear
from primitives.engine.core import (Check, ReduceOp, combine_, finish_avg_, flat_work, fuses, get_comm, resolve,
                             run, scratch, wait_all)
from primitives.engine.envelope import Fused


def _linear(comm, blocks, out, op):
    n, r = comm.size, comm.rank
    s = blocks[0].numel()
    work = scratch(comm, n * s, out.dtype, slot=2, device=out.device)
    for i, b in enumerate(blocks):                   # pack (and protect the caller's input)
        work[i * s:(i + 1) * s].copy_(b)
    _reduce_linear(comm, work, 0, op)
    if r == 0:
        wait_all([comm.isend(work[p * s:(p + 1) * s], p) for p in range(1, n)])
        out.copy_(work[:s])
    else:
        comm.recv(out, 0)


def _ring(comm, blocks, out, op):
    n, r = comm.size, comm.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    slots = [scratch(comm, out.numel(), out.dtype, slot=i, device=out.device) for i in (0, 1)]
    send = blocks[(r - 1) % n]
    for s in range(n - 1):                        # one group per step (prev == nxt at N = 2)
        inc = slots[s % 2]                         # never the slot whose send is in this group
        wait_all(comm.exchange(sends=[(send, nxt)], recvs=[(inc, prev)]))
        combine_(inc, blocks[(r - s - 2) % n], op)
        send = inc
    out.copy_(inc)


def _direct(comm, blocks, out, op):
    n, r, k = comm.size, comm.rank, out.numel()
    tmp = scratch(comm, (n - 1) * k, out.dtype, device=out.device).view(n - 1, k)
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(blocks[p], p) for p in peers], recvs=[(tmp[i], p) for i, p in enumerate(peers)]))
    rows = {p: tmp[i] for i, p in enumerate(peers)}
    rows[r] = blocks[r]
    acc = scratch(comm, k, out.dtype, slot=1, device=out.device).copy_(rows[0])   # out may alias blocks[r]
    for p in range(1, n):                            # fixed rank order: deterministic
        combine_(acc, rows[p], op)
    out.copy_(acc)


def _hierarchical(comm, blocks, out, op):   # multinode: intra rings per node, then an inter ring
    from primitives.engine.hierarchical import reduce_scatter_2level
    reduce_scatter_2level(comm, blocks, out, op)


ALGOS = {"linear": _linear, "ring": _ring, "direct": _direct, "hierarchical": _hierarchical,
         "shm": shm_collectives.reduce_scatter}  # "shm": shm transport only


def _run(name, blocks, output, comm, check, opn, algorithm, ok, async_op, tag=0):
    nbytes = output.numel() * output.element_size() * comm.size if ok else 0
    algo = resolve(name, algorithm, ALGOS, comm, nbytes, check)

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
             if ok and output.numel() and fuses(name, algo, comm, nbytes) else None)
    return run(comm, name, algo, check, numel=output.numel() if ok else -1,
               dtype=output.dtype if ok else None, op=opn, root=-1,
               shape=tuple(output.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               fused=fused)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter(output, input_list, op)."""
    comm = get_comm(group)
    check = Check(comm, "reduce_scatter")
    ok = check.tensor("output", output) and check.tensor_list("input_list", input_list, output)
    opn = check.op(op, output.dtype if ok else None)
    return _run("reduce_scatter", lambda: input_list, output, comm, check, opn, algorithm, ok, async_op, tag=tag)


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.reduce_scatter_single: input holds N blocks of output.numel() elements."""
    comm = get_comm(group)
    check = Check(comm, "reduce_scatter_single")
    ok = check.tensor("output", output) and check.tensor("input", input)
    if ok and output.dtype != input.dtype:
        check.fail(f"argument 'input' has dtype {input.dtype}, expected {output.dtype} like 'output'")
        ok = False
    if ok:
        check.sizes(f"argument 'input' must hold world_size({comm.size}) × output.numel()({output.numel()})",
                    input.numel(), comm.size * output.numel())
        ok = not check.errors
    opn = check.op(op, output.dtype if ok else None)
    blocks = lambda: list(flat_work(input)[0].tensor_split(comm.size))  # noqa: E731
    return _run("reduce_scatter_single", blocks, output, comm, check, opn, algorithm, ok, async_op, tag=tag)


if __name__ == "__main__":
    from primitives.engine.runner import main
    main("reduce_scatter")
