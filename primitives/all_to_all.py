"""All-to-all from point-to-point: rank r's block p goes to rank p, which stores it as block r.

    torchrun --nproc_per_node 4 primitives/all_to_all.py
    mpiexec -n 4 python primitives/all_to_all.py --backend mpi

Drop-in for torch.distributed:
    all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False)
    all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False)
Split sizes count rows of dim 0 (None = dim 0 divided evenly by N), so blocks may be uneven.
It is the transpose of a distributed N×N matrix of blocks: what Ulysses sequence parallelism
uses to turn "my sequence slice, every head" into "every position, my heads"
(tensor_parallel/engine/ulysses.py).

Cost, S_p = bytes this rank sends to rank p (even splits: S_p = S/N, S = this rank's input):
  linear    one round: post every receive and every send at once (Open MPI's "basic linear"),
            staggered r+1, r+2, … so nobody is everyone's first peer.
            N-1 messages, Σ_{p≠r} S_p bytes per rank.      α + (N-2)·o + (N-1)/N·S·β
  pairwise  N-1 steps; at step s rank r sends to r+s and receives from r-s (Open MPI's
            "pairwise exchange"): at most one message in flight each way, so no receiver is
            flooded.  Same messages and bytes.              (N-1)(α + S/N·β)
Every byte but the local block crosses the wire once, so busbw = algbw·(N-1)/N.

Bad input: with the handshake on, every rank first sends every peer the element counts it will
send and expects (2N int64, control traffic), so mismatched splits raise a CollectiveError on
every rank naming both ranks, instead of gloo aborting the receiver. torch 2.13's gloo has the
even and uneven single forms, but its list form refuses tensors of different sizes: the reference
(`builtin`) sends those through gloo's uneven single form instead.
"""
from __future__ import annotations

import torch

from primitives.engine.core import Check, CollectiveError, flat_work, get_comm, handshake_enabled, resolve, run, wait_all
from primitives.engine.ledger import LEDGER


def _linear(comm, send, recv):
    n, r = comm.size, comm.rank
    peers = [(r + i) % n for i in range(1, n)]
    wait_all([comm.irecv(recv[p], p) for p in peers] + [comm.isend(send[p], p) for p in peers])


def _pairwise(comm, send, recv):
    n, r = comm.size, comm.rank
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        wait_all([comm.irecv(recv[frm], frm), comm.isend(send[to], to)])


ALGOS = {"linear": _linear, "pairwise": _pairwise}


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
            reqs = [comm.irecv(rows[p], p) for p in range(n) if p != me]
            reqs += [comm.isend(out, p) for p in range(n) if p != me]
            wait_all(reqs)
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


def _go(name, comm, check, algorithm, async_op, tag, send_counts, recv_counts, views, elem, dtype, shape):
    """views() -> (send blocks, recv blocks, finish); run the algorithm under the handshake."""
    n = comm.size
    nbytes = sum(send_counts) * elem if not check.errors else 0     # S: this rank's whole input
    # the model's two predictions differ only in latency (same bytes), so "auto" does not depend on
    # S: uneven splits give ranks different S, and every rank must pick the same algorithm
    algo = resolve(name, algorithm, ALGOS, comm, 0, check)
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
    return run(comm, name, algo, check, numel=total, dtype=dtype if not check.errors else None, op=None,
               root=-1, shape=shape, nbytes=nbytes, body=body, async_op=async_op, tag=tag)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all_single: rows input_split_sizes[p] of `input` go to rank p;
    output_split_sizes[p] rows of `output` come from rank p (None = dim 0 split evenly)."""
    comm = get_comm(group)
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
    return _go(name, comm, check, algorithm, async_op, tag, send_counts, recv_counts, views,
               input.element_size() if ok else 0, input.dtype if ok else None,
               tuple(input.shape[1:]) if ok else ())


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, *, algorithm="auto", tag=0):
    """Like torch.distributed.all_to_all: output_tensor_list[p] <- rank p's input_tensor_list[me]."""
    comm = get_comm(group)
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
               input_tensor_list[0].element_size() if ok else 0, dtype, ())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same storage: play safe and send from a copy (in-place all-to-all)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def builtin(name, comm, *args, **kw):
    """The backend's own all-to-all (the reference): torch.distributed, or mpi4py's Alltoallv."""
    if comm.backend != "mpi":
        out, inp = args
        if name == "all_to_all" and len({tuple(t.shape) for t in [*out, *inp]}) > 1:
            # gloo's list form needs every tensor the same size ("input and output tensors must
            # have the same size"); its uneven single form does not, so route through that
            sc, rc = [t.numel() for t in inp], [t.numel() for t in out]
            recv = torch.empty(sum(rc), dtype=inp[0].dtype)
            torch.distributed.all_to_all_single(recv, torch.cat([t.reshape(-1) for t in inp]), rc, sc, group=comm.group)
            for t, piece in zip(out, recv.split(rc)):
                t.copy_(piece.view_as(t))
            return None
        return getattr(torch.distributed, name)(*args, group=comm.group, **kw)
    from mpi4py import MPI
    if name == "all_to_all":
        out, inp = args
        send = torch.cat([t.reshape(-1) for t in inp])
        recv = torch.empty(sum(t.numel() for t in out), dtype=send.dtype)
        sc, rc = [t.numel() for t in inp], [t.numel() for t in out]
    else:
        out, inp = args
        row = inp[0].numel() if inp.shape[0] else 0
        n = comm.size
        sc = [s * row for s in (kw.get("input_split_sizes") or [inp.shape[0] // n] * n)]
        rc = [s * row for s in (kw.get("output_split_sizes") or [out.shape[0] // n] * n)]
        send, recv = inp.contiguous().reshape(-1), torch.empty(out.numel(), dtype=out.dtype)
    es = send.element_size()
    spec = lambda t, c: [t.view(torch.uint8).numpy(), [x * es for x in c], [sum(c[:i]) * es for i in range(len(c))], MPI.BYTE]  # noqa: E731
    comm.mpi.Alltoallv(spec(send, sc), spec(recv, rc))
    if name == "all_to_all":
        for t, piece in zip(out, recv.split(rc)):
            t.copy_(piece.view_as(t))
    else:
        out.copy_(recv.view_as(out))


def main(argv=None) -> None:
    """Check both algorithms (even and uneven splits) against the built-in, the ledger against
    cost.traffic, and time them interleaved with the built-in."""
    import argparse
    import statistics
    import time

    from rich.table import Table

    from primitives.engine.cost import traffic
    from primitives.engine.launch import add_launch_args, init_from_env
    from primitives.engine.log import print0
    ap = argparse.ArgumentParser(description="Run, verify and time every all-to-all algorithm.")
    add_launch_args(ap)
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes of each rank's input (default 1 MiB)")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    comm = init_from_env(a.backend, a.timeout)
    n, r = comm.size, comm.rank
    rows = max(n, a.size // 4 // n * n)
    uneven = [((r + p) % 3) * rows // (2 * n) for p in range(n)]          # rank r sends uneven[p] rows to p
    uneven[r] += rows - sum(uneven)
    got = [((p + r) % 3) * rows // (2 * n) if p != r else 0 for p in range(n)]
    got[r] = uneven[r]
    x = torch.randint(-9, 9, (rows,), dtype=torch.float32)
    t = Table(title=f"all_to_all_single: {n} ranks, {rows * 4:,} bytes per rank, backend {comm.backend}")
    for c in ("algorithm", "splits", "check vs built-in", "bytes sent (rank 0)", "= formula", "median ms (ours)",
              "median ms (built-in)", "busbw GB/s"):
        t.add_column(c, justify="left" if c in ("algorithm", "splits", "check vs built-in") else "right")
    bad = 0
    for algo in [*ALGOS, "auto"]:
        for label, ins, outs in (("even", None, None), ("uneven", uneven, got)):
            y, ref = torch.empty(sum(outs) if outs else rows), torch.empty(sum(outs) if outs else rows)
            with LEDGER.track() as d:
                all_to_all_single(y, x, outs, ins, algorithm=algo)
            builtin("all_to_all_single", comm, ref, x, output_split_sizes=outs, input_split_sizes=ins)
            exp = traffic("all_to_all_single", LEDGER.calls[-1].algorithm, n, r, rows, 4, splits=ins)
            ok, fok = torch.equal(y, ref), (d.msgs_sent, d.bytes_sent) == exp
            bad += (not ok) + (not fok)
            times = {"ours": [], "ref": []}
            for _ in range(a.iters):                                      # interleaved
                for side in ("ours", "ref"):
                    torch.distributed.barrier(group=comm.group) if comm.backend != "mpi" else comm.mpi.Barrier()
                    t0 = time.perf_counter()
                    if side == "ours":
                        all_to_all_single(y, x, outs, ins, algorithm=algo)
                    else:
                        builtin("all_to_all_single", comm, ref, x, output_split_sizes=outs, input_split_sizes=ins)
                    times[side].append(time.perf_counter() - t0)
            mo, mr = statistics.median(times["ours"]), statistics.median(times["ref"])
            t.add_row(algo, label, "[green]pass[/]" if ok else "[red]FAIL[/]", f"{d.bytes_sent:,}",
                      "[green]yes[/]" if fok else "[red]NO[/]", f"{mo * 1e3:.3f}", f"{mr * 1e3:.3f}",
                      f"{rows * 4 / mo * (n - 1) / n / 1e9:.3f}" if n > 1 else "-")
    print0(t)
    print0("busbw = S / time × (N-1)/N, S = this rank's input. Timings include the handshake (the default).")
    if bad:
        raise SystemExit(f"rank {r}: {bad} check(s) failed")


if __name__ == "__main__":
    main()
