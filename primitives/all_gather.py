"""All-gather from point-to-point: every rank ends with every rank's tensor, in rank order.

    torchrun --nproc_per_node 4 primitives/all_gather.py        (also: primitives/allgather.py)
    mpiexec -n 4 python primitives/all_gather.py --backend mpi

Cost, S = bytes each rank contributes (the output holds N·S):
  linear  gather to rank 0, which then sends each rank the N-1 blocks it lacks.
          Rank 0 sends (N-1)² messages, (N-1)²·S bytes; the others send S once.
  ring    N-1 steps; at step s rank r passes block (r-s) on to r+1.
          N-1 messages, (N-1)·S bytes per rank.           (N-1)(α + Sβ)
  direct  one round: every rank posts a receive from, and a send of its block to, every
          other rank at once (staggered r+1, r+2, … so nobody is everyone's first peer).
          Same bytes as the ring, N-1 messages, but no step waits for another: on an
          oversubscribed host that is what matters.       α + (N-1)·o + (N-1)Sβ
  hierarchical  across m nodes × k ranks: inter ring, then intra rings (primitives/engine/hierarchical.py);
          (m-1)·S inter-node and m(k-1)·S intra-node bytes per rank.
          With the check on and S ≤ 64 KiB per rank, the blocks ride in the check's
          envelopes (envelope.py): one round for check and data, what auto picks.
"""
from __future__ import annotations

from primitives.engine import shm_collectives
from primitives.engine.core import Check, flat_work, fuses, get_comm, resolve, run, wait_all
from primitives.engine.envelope import Fused


def _linear(comm, blocks):
    n, r = comm.size, comm.rank
    if r == 0:
        wait_all([comm.irecv(blocks[p], p) for p in range(1, n)])
        wait_all([comm.isend(blocks[i], p) for p in range(1, n) for i in range(n) if i != p])
    else:
        comm.send(blocks[r], 0)
        wait_all([comm.irecv(blocks[i], 0) for i in range(n) if i != r])


def _ring(comm, blocks):
    n, r = comm.size, comm.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                        # one group per step (prev == nxt at N = 2)
        wait_all(comm.exchange(sends=[(blocks[(r - s) % n], nxt)], recvs=[(blocks[(r - s - 1) % n], prev)]))


def _direct(comm, blocks):
    n, r = comm.size, comm.rank
    peers = [(r + i) % n for i in range(1, n)]
    wait_all(comm.exchange(sends=[(blocks[r], p) for p in peers], recvs=[(blocks[p], p) for p in peers]))


def _hierarchical(comm, blocks):   # multinode: inter ring of my block, then intra rings per node
    from primitives.engine.hierarchical import all_gather_2level
    all_gather_2level(comm, blocks)


ALGOS = {"linear": _linear, "ring": _ring, "direct": _direct, "hierarchical": _hierarchical,
         "shm": shm_collectives.all_gather}  # "shm": shm transport only


def _run(name, blocks, tensor, comm, check, algorithm, ok, async_op, post=None, tag=0):
    nbytes = tensor.numel() * tensor.element_size() * comm.size if ok else 0   # S: the full output
    algo = resolve(name, algorithm, ALGOS, comm, nbytes, check)

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
             if ok and tensor.numel() and fuses(name, algo, comm, nbytes) else None)
    return run(comm, name, algo, check, numel=tensor.numel() if ok else -1,
               dtype=tensor.dtype if ok else None, op=None, root=-1,
               shape=tuple(tensor.shape) if ok else (), nbytes=nbytes, body=body, async_op=async_op, tag=tag,
               fused=fused)


def all_gather(tensor_list, tensor, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather(tensor_list, tensor): tensor_list[i] <- rank i's tensor."""
    comm = get_comm(group)
    check = Check(comm, "all_gather")
    ok = check.tensor("tensor", tensor) and check.tensor_list("tensor_list", tensor_list, tensor)
    return _run("all_gather", lambda: tensor_list, tensor, comm, check, algorithm, ok, async_op, tag=tag)


def all_gather_single(output, input, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_gather_single: output (N·numel elements) <- all inputs, rank-major."""
    comm = get_comm(group)
    check = Check(comm, "all_gather_single")
    ok = check.tensor("input", input) and check.tensor("output", output)
    if ok and output.dtype != input.dtype:
        check.fail(f"argument 'output' has dtype {output.dtype}, expected {input.dtype} like 'input'")
        ok = False
    if ok:
        check.sizes(f"argument 'output' must hold world_size({comm.size}) × input.numel()({input.numel()})",
                    output.numel(), comm.size * input.numel())
        ok = not check.errors
    out = output if not ok or output.is_contiguous() else output.contiguous()
    blocks = lambda: list(out.view(-1).tensor_split(comm.size))  # noqa: E731
    post = None if out is output else (lambda: output.copy_(out))
    return _run("all_gather_single", blocks, input, comm, check, algorithm, ok, async_op, post, tag=tag)


if __name__ == "__main__":
    from primitives.engine.runner import main
    main("all_gather")
