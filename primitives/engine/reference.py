"""The backend's own collectives, called the same way as ours: the reference every check,
test and benchmark compares against. torch.distributed for gloo/nccl, mpi4py for MPI.

ref(name, comm, *args) mirrors primitives.<name>(*args) and returns nothing (in place).
gloo has no AVG reduction: AVG is SUM divided by N here, which is what AVG means.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from primitives.engine.algos import group_rank
from primitives.engine.check import op_name

_MPI_OPS = {"sum": "SUM", "product": "PROD", "min": "MIN", "max": "MAX", "avg": "SUM"}
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
              "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM}


def ref(name: str, comm, *args, op=None, **kw) -> None:
    if name in ("all_to_all", "all_to_all_single"):
        return _ref_all_to_all(name, comm, *args, **kw)     # kw: the single form's split sizes
    opn = op_name(op) if op is not None else "sum"
    if comm.backend == "mpi":
        _ref_mpi(name, comm, args, opn)
    else:
        _ref_torch(name, comm, args, opn)
    if opn == "avg":
        target = {"all_reduce": args[0], "reduce": args[0], "reduce_scatter": args[0],
                  "reduce_scatter_single": args[0]}[name]
        if name != "reduce" or comm.rank == group_rank(comm, args[1]):
            target.div_(comm.size)


def _ref_torch(name, comm, args, opn):
    g, op = comm.group, _TORCH_OPS[opn]
    if name == "broadcast":
        dist.broadcast(args[0], args[1], group=g)
    elif name == "reduce":
        dist.reduce(args[0], args[1], op=op, group=g)
    elif name == "all_reduce":
        dist.all_reduce(args[0], op=op, group=g)
    elif name == "all_gather":
        dist.all_gather(args[0], args[1], group=g)
    elif name == "all_gather_single":   # torch 2.13 name; older torch calls it all_gather_into_tensor
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(args[0], args[1], group=g)
    elif name == "reduce_scatter":
        dist.reduce_scatter(args[0], list(args[1]), op=op, group=g)
    elif name == "reduce_scatter_single":  # older torch: reduce_scatter_tensor
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(args[0], args[1], op=op, group=g)
    elif name == "scatter":
        dist.scatter(args[0], args[1] if comm.rank == group_rank(comm, args[2]) else None, src=args[2], group=g)
    elif name == "gather":
        dist.gather(args[0], args[1] if comm.rank == group_rank(comm, args[2]) else None, dst=args[2], group=g)
    else:
        raise KeyError(name)


def _ref_mpi(name, comm, args, opn):
    """mpi4py on numpy views; float16/bfloat16 travel as bytes where no reduction is needed."""
    from mpi4py import MPI   # optional dependency: only `--backend mpi` needs it
    m = comm.mpi
    op = getattr(MPI, _MPI_OPS[opn])

    def buf(t):
        if t.dtype in (torch.float16, torch.bfloat16):
            return [t.view(torch.uint8).numpy(), MPI.BYTE]
        return t.numpy()
    if name == "broadcast":
        m.Bcast(buf(args[0]), root=args[1])
    elif name == "reduce":
        t = args[0]
        out = t.clone()
        m.Reduce(t.numpy(), out.numpy(), op=op, root=args[1])
        if comm.rank == args[1]:
            t.copy_(out)
    elif name == "all_reduce":
        m.Allreduce(MPI.IN_PLACE, args[0].numpy(), op=op)
    elif name in ("all_gather", "all_gather_single"):
        if name == "all_gather":
            out = torch.empty((len(args[0]),) + tuple(args[1].shape), dtype=args[1].dtype)
        else:
            out = args[0]
        m.Allgather(buf(args[1].contiguous()), buf(out))
        if name == "all_gather":
            for i, t in enumerate(args[0]):
                t.copy_(out[i])
    elif name in ("reduce_scatter", "reduce_scatter_single"):
        inp = torch.cat([t.reshape(-1) for t in args[1]]) if name == "reduce_scatter" else args[1].contiguous()
        m.Reduce_scatter_block(inp.numpy(), args[0].numpy(), op=op)
    elif name == "scatter":
        send = torch.stack(list(args[1])).contiguous() if comm.rank == args[2] else None
        m.Scatter(buf(send) if send is not None else None, buf(args[0]), root=args[2])
    elif name == "gather":
        recv = torch.empty((comm.size,) + tuple(args[0].shape), dtype=args[0].dtype) if comm.rank == args[2] else None
        m.Gather(buf(args[0].contiguous()), buf(recv) if recv is not None else None, root=args[2])
        if recv is not None:
            for i, t in enumerate(args[1]):
                t.copy_(recv[i])
    else:
        raise KeyError(name)


def _ref_all_to_all(name, comm, *args, **kw):
    """torch.distributed's all_to_all(_single), or mpi4py's Alltoallv. torch 2.13's gloo has the even
    and uneven single forms, but its list form refuses tensors of different sizes: those go
    through gloo's uneven single form instead."""
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
    from mpi4py import MPI   # optional dependency: only `--backend mpi` needs it
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
