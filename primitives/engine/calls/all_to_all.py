"""The checked all_to_all(_single): argument checks, a count exchange, the ledger and "auto"
around the textbook algorithms of primitives/all_to_all.py.

    torchrun --nproc_per_node 4 primitives/run.py all_to_all

Split sizes count rows of dim 0 (None = dim 0 divided evenly by N), so blocks may be uneven.
Bad input: with the handshake on, every rank first sends every peer the element counts it will
send and expects (2N int64, control traffic), so mismatched splits raise a CollectiveError on
every rank naming both ranks, instead of gloo aborting the receiver.
"""
from __future__ import annotations

import torch

from primitives.all_to_all import linear, pairwise
from primitives.engine.check import Check
from primitives.engine.core import flat_work, run
from primitives.engine.errors import CollectiveError
from primitives.engine.ledger import LEDGER
from primitives.engine.planned import handshake_enabled, plan
from primitives.ops import wait_all


ALGOS = {"linear": linear, "pairwise": pairwise}


def _exchange_counts(comm, name, check, send_counts, recv_counts):
    """Every rank learns every rank's (send, expect) element counts; inconsistencies become
    the same error on every rank. A rank whose own arguments are bad sends -1s."""
    n, me = comm.size, comm.rank
    ok = not check.errors
    mine = torch.tensor((send_counts + recv_counts) if ok else [-1] * 2 * n, dtype=torch.int64)
    table = torch.empty((n, 2 * n), dtype=torch.int64)
    table[me] = mine
    if n > 1:
        with LEDGER.control_traffic():
            dev = comm.device
            rows = [torch.empty(2 * n, dtype=torch.int64, device=dev) for _ in range(n)]
            out = mine.to(dev)
            peers = [p for p in range(n) if p != me]   # one group, nccl-safe
            wait_all(comm.exchange(sends=[(out, p) for p in peers], recvs=[(rows[p], p) for p in peers]))
            for p in range(n):
                if p != me:
                    table[p] = rows[p].cpu()
    t = table.tolist()
    good = [p for p in range(n) if t[p][0] >= 0]
    for i in good:
        for j in good:
            sent, expected = t[i][j], t[j][n + i]
            if sent != expected:
                check.fail(f"rank {i} sends {sent} elements to rank {j} but rank {j} expects {expected} "
                           f"from rank {i} (split sizes × elements per row must match pairwise)")
                return sum(map(sum, t))
    return sum(sum(t[p][:n]) for p in good)


def _splits(check, arg, sizes, rows, n):
    """Rows per peer from a split-size list (None = even), or None after recording an error."""
    if sizes is None:
        if rows % n:
            check.fail(f"argument {arg!r} is None, so dim 0 ({rows}) must be divisible by world_size ({n})")
            return None
        return [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in sizes):
        check.fail(f"argument {arg!r} must be {n} non-negative ints (one per rank), got {sizes}")
        return None
    if sum(sizes) != rows:
        check.fail(f"argument {arg!r} sums to {sum(sizes)} but dim 0 of the tensor is {rows}")
        return None
    return sizes


def _go(name, comm, check, algorithm, async_op, tag, send_counts, recv_counts, views, like, shape):
    """views() -> (send blocks, recv blocks, finish); run the algorithm under the handshake. like: a
    tensor of the call's dtype (for the fingerprint), when the arguments passed."""
    n = comm.size
    nbytes = sum(send_counts) * like.element_size() if not check.errors else 0     # S: this rank's whole input
    # the model's two predictions differ only in latency (same bytes), so "auto" does not depend on
    # S: uneven splits give ranks different S, and every rank must pick the same algorithm
    pl = plan(name, algorithm, ALGOS, comm, 0, check)
    algo = pl.algo
    total = -1
    if handshake_enabled():
        total = _exchange_counts(comm, name, check, send_counts, recv_counts)
    elif check.errors:
        raise CollectiveError(f"rank {comm.rank}: {name}: " + "; ".join(check.errors))

    def body():
        send, recv, finish = views()
        me = comm.rank
        recv[me].copy_(send[me])
        if n > 1:
            ALGOS[algo](comm, send, recv)
        finish()
    return run(comm, name, check, pl, not check.errors, like, body, async_op, tag, nbytes, numel=total,
               shape=shape)


def all_to_all_single(comm, output, input, output_split_sizes=None, input_split_sizes=None,
                      async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all_single: rows input_split_sizes[p] of `input` go to rank p;
    output_split_sizes[p] rows of `output` come from rank p (None = dim 0 split evenly)."""
    n = comm.size
    check = Check(comm, name := "all_to_all_single")
    ok = check.tensor("output", output) and check.tensor("input", input)
    if ok and output.dtype != input.dtype:
        check.fail(f"argument 'output' has dtype {output.dtype}, expected {input.dtype} like 'input'")
        ok = False
    if ok and (input.dim() == 0 or output.dim() == 0):
        check.fail("arguments 'input' and 'output' need at least one dimension (blocks are rows of dim 0)")
        ok = False
    if ok and tuple(input.shape[1:]) != tuple(output.shape[1:]):
        check.fail(f"argument 'output' has rows of shape {tuple(output.shape[1:])}, expected "
                   f"{tuple(input.shape[1:])} like 'input'")
        ok = False
    ins = _splits(check, "input_split_sizes", input_split_sizes, input.shape[0], n) if ok else None
    outs = _splits(check, "output_split_sizes", output_split_sizes, output.shape[0], n) if ok else None
    row = input[0].numel() if ok and input.shape[0] else (output[0].numel() if ok and output.shape[0] else 0)
    send_counts = [s * row for s in ins] if ins and outs else [0] * n
    recv_counts = [s * row for s in outs] if ins and outs else [0] * n

    def views():
        src = flat_work(input)[0]
        if ok and output.numel() and input.numel() and _overlap(src, output):
            src = src.clone()                      # in place: keep the blocks still to be sent
        dst, copied = flat_work(output)
        send = list(src.split(send_counts))
        recv = list(dst.split(recv_counts))
        return send, recv, (lambda: output.copy_(dst.view_as(output))) if copied else (lambda: None)
    return _go(name, comm, check, algorithm, async_op, tag, send_counts, recv_counts, views, input,
               tuple(input.shape[1:]) if ok else ())


def all_to_all(comm, output_tensor_list, input_tensor_list, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all: output_tensor_list[p] <- rank p's input_tensor_list[me]."""
    n = comm.size
    check = Check(comm, name := "all_to_all")
    ok = True
    for arg, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if not isinstance(lst, (list, tuple)) or len(lst) != n:
            got = f"length {len(lst)}" if isinstance(lst, (list, tuple)) else type(lst).__name__
            check.fail(f"argument {arg!r} must be a list of {n} tensors (one per rank), got {got}")
            ok = False
        else:
            ok = ok and all(check.tensor(f"{arg}[{i}]", t) for i, t in enumerate(lst))
    dtype = input_tensor_list[0].dtype if ok else None
    if ok:
        bad = [f"{a}[{i}]" for a, lst in (("output_tensor_list", output_tensor_list),
                                         ("input_tensor_list", input_tensor_list))
               for i, t in enumerate(lst) if t.dtype != dtype]
        if bad:
            check.fail(f"arguments {bad} differ in dtype from input_tensor_list[0] ({dtype})")
            ok = False
    send_counts = [t.numel() for t in input_tensor_list] if ok else [0] * n
    recv_counts = [t.numel() for t in output_tensor_list] if ok else [0] * n

    def views():
        send = [flat_work(t)[0] for t in input_tensor_list]
        if any(_overlap(s, o) for s in send for o in output_tensor_list if s.numel() and o.numel()):
            send = [s.clone() for s in send]
        work = [flat_work(t) for t in output_tensor_list]

        def finish():
            for o, (w, copied) in zip(output_tensor_list, work):
                if copied:
                    o.copy_(w.view_as(o))
        return send, [w for w, _ in work], finish
    return _go(name, comm, check, algorithm, async_op, tag, send_counts, recv_counts, views,
               input_tensor_list[0] if ok else None, ())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same storage: play safe and send from a copy (in-place all-to-all)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
