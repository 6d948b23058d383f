"""Correctness and ledger checks for every collective × algorithm, backend-agnostic.

Used by the gloo tests (through the spawn fixture), tests/mpi_worker.py (under mpiexec) and
tests/test_nccl.py. Every function here runs ON A RANK and returns plain data: a list of
error strings (empty = all good) plus per-case traffic and result digests, so the test
process can compare ranks with each other.

The reference is the backend's own collective (primitives.engine.reference.ref: torch.distributed
for gloo/nccl, mpi4py for MPI), called on contiguous clones of the same inputs.

Tolerances (floating SUM / AVG / PRODUCT only; everything else must be bitwise equal):
  Each algorithm adds N numbers in some order, rounding every partial sum to the dtype. One
  rounding costs at most u·|partial| ≤ u·Σ|x| (u = eps/2), so any order lands within
  (N-1)·u·Σ|x| of the exact sum and two orders within (N-1)·eps·Σ|x|. We allow N·eps·Σ|x|
  (elementwise Σ over ranks of |x|, computed in float64 from regenerated inputs). AVG divides
  that by N and adds one rounding of the quotient (eps·|ref|). PRODUCT of values near 1: every
  multiply rounds relatively, so the bound is N·eps·Π|x|.
"""
from __future__ import annotations

import hashlib
import math

import torch

import primitives as P
from primitives.engine.cost import traffic
from primitives.engine.ledger import LEDGER
from primitives.engine.reference import ref
from primitives.engine.shm_collectives import one_shot
from primitives.ops import PIPELINE_BYTES

REDUCING = {"reduce", "all_reduce", "reduce_scatter", "reduce_scatter_single"}
ROOTED = {"broadcast", "reduce", "scatter", "gather"}
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _gen(seed: int, rank: int, slot: int, numel: int, dtype, op: str) -> torch.Tensor:
    """Deterministic inputs: any rank can regenerate any other rank's data (for tolerances)."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + slot)
    if dtype.is_floating_point:
        if op == "product":
            x = 1.0 + 0.05 * torch.randn(numel, generator=g, dtype=torch.float64)   # near 1: no overflow
        else:
            x = torch.randn(numel, generator=g, dtype=torch.float64) * 4
    elif op == "product":
        x = torch.randint(-2, 3, (numel,), generator=g)                           # |Π| ≤ 2^8
    else:
        x = torch.randint(-1000, 1000, (numel,), generator=g)
    return x.to(dtype)


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in a given memory layout: 'contig', 'strided' (every other element of a
    bigger buffer) or 'transposed' (a 2-D transposed view; numel must factor as a×b)."""
    if layout == "contig":
        return x.clone()
    if layout == "strided":
        base = torch.full((2 * x.numel() + 1,), 99, dtype=x.dtype, device=x.device)
        v = base[1::2]
        v.copy_(x)
        assert x.numel() <= 1 or not v.is_contiguous()
        return v
    if layout == "transposed":
        n = x.numel()
        a = next((d for d in (3, 5, 7, 2) if n % d == 0 and n // d > 1), None)
        if a is None:
            return _layout(x, "strided")
        base = torch.empty((a, n // a), dtype=x.dtype, device=x.device)
        v = base.t()                                  # shape (n/a, a), not contiguous
        v.copy_(x.view(n // a, a))                    # same logical (row-major) order as x
        assert not v.is_contiguous()
        return v
    raise KeyError(layout)


def _empty_like_layout(numel: int, dtype, device, layout: str) -> torch.Tensor:
    return _layout(torch.full((numel,), -7, dtype=dtype, device=device) if dtype != torch.bool else
                   torch.zeros(numel, dtype=dtype, device=device), layout)


def _tol(name, dtype, op, n, inputs_abs_sum, inputs_abs_prod, refval):
    """Allowed |ours - built-in| elementwise (see the module docstring); None = bitwise."""
    if not dtype.is_floating_point or op in ("min", "max") or name not in REDUCING:
        return None
    eps = torch.finfo(dtype).eps
    if op == "product":
        return n * eps * inputs_abs_prod
    if op == "avg":
        return eps * inputs_abs_sum + eps * refval.abs()
    return n * eps * inputs_abs_sum


def _compare(what, ours, theirs, tol, errs):
    ours = ours.reshape(-1).cpu()
    theirs = theirs.reshape(-1).cpu()
    if ours.shape != theirs.shape:
        errs.append(f"{what}: shape {tuple(ours.shape)} vs built-in {tuple(theirs.shape)}")
        return
    if tol is None:
        if not torch.equal(ours, theirs):
            bad = (ours != theirs).nonzero().reshape(-1)
            i = int(bad[0])
            errs.append(f"{what}: {bad.numel()} elements differ from the built-in (bitwise), "
                        f"first at [{i}]: {ours[i].item()} vs {theirs[i].item()}")
        return
    diff = (ours.double() - theirs.double()).abs()
    lim = tol.reshape(-1).cpu().double() * 1.0001 + 1e-300
    if (diff > lim).any():
        i = int((diff - lim).argmax())
        errs.append(f"{what}: |ours-built-in| = {diff[i].item():.3g} at [{i}] exceeds tolerance "
                    f"{lim[i].item():.3g} ({ours[i].item()} vs {theirs[i].item()})")


def digest(t: torch.Tensor) -> str:
    flat = torch.empty(t.numel(), dtype=t.dtype)   # a fresh dense buffer (a 1-element view may keep stride 2)
    flat.copy_(t.detach().reshape(-1).cpu())
    return hashlib.sha1(flat.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def check_case(comm, name, algo, *, numel, dtype=torch.int64, op="sum", root=0, layout="contig",
               seed=0, group=None, global_root=None, check_traffic=True, local=None):
    """Run primitives.<name> and the built-in on the same inputs; compare results and traffic.

    numel is the caller's tensor (reduce_scatter*: the output block; all_gather*: the input).
    root is a group rank; global_root the rank passed as src/dst (defaults to root).
    Returns (errors, info) with info = {"algorithm", "counts": (msgs_sent, bytes_sent,
    msgs_recv, bytes_recv), "digest"} for cross-rank checks in the test process.
    """
    n, r, dev = comm.size, comm.rank, comm.device
    groot = root if global_root is None else global_root
    opn = op
    top = {"sum": P.ReduceOp.SUM, "product": P.ReduceOp.PRODUCT, "min": P.ReduceOp.MIN,
           "max": P.ReduceOp.MAX, "avg": P.ReduceOp.AVG}[op]
    tag = f"{name}/{algo} N={n} rank={r} dtype={str(dtype).replace('torch.', '')} op={op} numel={numel} root={groot} layout={layout}"
    errs: list[str] = []

    def x_of(rank, slot=0, k=numel):
        return _gen(seed, rank, slot, k, dtype, op).to(dev)

    kw = {"group": group, "algorithm": algo}
    okw = {"op": top} if name in REDUCING else {}
    rkw = {"op": top} if name in REDUCING else {}
    ours_out, ref_out, keep = [], [], []           # (ours, built-in) pairs; (tensor, original) unchanged checks
    if name in ("broadcast", "reduce", "all_reduce"):
        x = x_of(r)
        a = _layout(x, layout)
        b = x.clone()
        pos = (a, groot) if name != "all_reduce" else (a,)
        with LEDGER.track() as d:
            getattr(P, name)(*pos, **okw, **kw)
        ref(name, comm, *((b, groot) if name != "all_reduce" else (b,)), **rkw)
        if name == "reduce" and r != root:
            keep.append((a, x))                     # non-dst tensors are left unchanged
        elif name == "broadcast" and r == root:
            ours_out.append((a, b)); keep.append((a, x))
        else:
            ours_out.append((a, b))
    elif name in ("all_gather", "all_gather_single"):
        x = x_of(r)
        a_in = _layout(x, layout)
        with LEDGER.track() as d:
            if name == "all_gather":
                la = [_empty_like_layout(numel, dtype, dev, layout) for _ in range(n)]
                P.all_gather(la, a_in, **kw)
            else:
                oa = _empty_like_layout(n * numel, dtype, dev, layout)
                P.all_gather_single(oa, a_in, **kw)
        if name == "all_gather":
            lb = [torch.zeros(numel, dtype=dtype, device=dev) for _ in range(n)]
            ref(name, comm, lb, x.clone())
            ours_out += list(zip(la, lb))
        else:
            ob = torch.zeros(n * numel, dtype=dtype, device=dev)
            ref(name, comm, ob, x.clone())
            ours_out.append((oa, ob))
        keep.append((a_in, x))
    elif name in ("reduce_scatter", "reduce_scatter_single"):
        blocks = [x_of(r, slot=i) for i in range(n)]
        full = torch.cat(blocks) if numel else torch.zeros(0, dtype=dtype, device=dev)
        oa = _empty_like_layout(numel, dtype, dev, layout)
        if name == "reduce_scatter":
            ins = [_layout(bk, layout) for bk in blocks]
        else:
            ins = _layout(full, layout)
        with LEDGER.track() as d:
            getattr(P, name)(oa, ins, **okw, **kw)
        ob = torch.zeros(numel, dtype=dtype, device=dev)
        ref(name, comm, ob, [bk.clone() for bk in blocks] if name == "reduce_scatter" else full.clone(), **rkw)
        ours_out.append((oa, ob))
        if name == "reduce_scatter":
            keep += list(zip(ins, blocks))
        else:
            keep.append((ins, full))
    elif name == "scatter":
        blocks = [x_of(r, slot=i) for i in range(n)] if r == root else None
        oa = _empty_like_layout(numel, dtype, dev, layout)
        sl = [_layout(bk, layout) for bk in blocks] if blocks is not None else None
        with LEDGER.track() as d:
            P.scatter(oa, sl, groot, **kw)
        ob = torch.zeros(numel, dtype=dtype, device=dev)
        ref(name, comm, ob, [bk.clone() for bk in blocks] if blocks is not None else None, groot)
        ours_out.append((oa, ob))
        if blocks is not None:
            keep += list(zip(sl, blocks))
    elif name == "gather":
        x = x_of(r)
        a_in = _layout(x, layout)
        la = [_empty_like_layout(numel, dtype, dev, layout) for _ in range(n)] if r == root else None
        with LEDGER.track() as d:
            P.gather(a_in, la, groot, **kw)
        lb = [torch.zeros(numel, dtype=dtype, device=dev) for _ in range(n)] if r == root else None
        ref(name, comm, x.clone(), lb, groot)
        if la is not None:
            ours_out += list(zip(la, lb))
        keep.append((a_in, x))
    else:
        raise KeyError(name)

    # tolerance inputs: regenerate every rank's contribution to my result, in float64
    abs_sum = abs_prod = None
    if name in REDUCING and dtype.is_floating_point and op not in ("min", "max"):
        if name in ("reduce", "all_reduce"):
            xs = [x_of(p).double() for p in range(n)]
        else:                                       # my output block r: slot r of every rank's input
            xs = [x_of(p, slot=r).double() for p in range(n)]
        abs_sum = sum(t.abs() for t in xs) if op != "avg" else sum(t.abs() for t in xs) / n
        abs_prod = torch.stack(xs).abs().prod(0) if xs else None

    for i, (ours, theirs) in enumerate(ours_out):
        tol = _tol(name, dtype, op, n, abs_sum, abs_prod, theirs.double()) if abs_sum is not None else None
        _compare(f"{tag} output[{i}]", ours, theirs, tol, errs)
    for i, (t, orig) in enumerate(keep):
        if not torch.equal(t.reshape(-1).cpu(), orig.reshape(-1).cpu()):
            errs.append(f"{tag}: input/unchanged tensor #{i} was modified")
    if layout == "strided":                         # writes through a strided view never touch the gaps
        for i, (t, _) in enumerate(ours_out + keep):
            if t.dim() == 1 and t.numel() > 1:
                gaps = torch.as_strided(t, (t.numel() + 1,), (2,), t.storage_offset() - 1)
                if not bool((gaps == 99).all()):
                    errs.append(f"{tag}: tensor #{i} was written outside its strided view")
    used = LEDGER.calls[-1].algorithm if LEDGER.calls else "?"
    if algo != "auto" and used != algo:
        errs.append(f"{tag}: ledger says algorithm {used!r}")
    if used not in P.algorithms_for(name, comm):
        errs.append(f"{tag}: auto chose {used!r}, not one of {P.algorithms_for(name, comm)}")
    counts = (d.msgs_sent, d.bytes_sent, d.msgs_recv, d.bytes_recv)
    if check_traffic:
        elem = torch.empty(0, dtype=dtype).element_size()
        exp = traffic(name, used, n, r, numel, elem, root, local=local)   # local: ranks per node (multinode)
        if (d.msgs_sent, d.bytes_sent) != exp:
            errs.append(f"{tag}: ledger (msgs, bytes) sent {(d.msgs_sent, d.bytes_sent)} != cost.traffic {exp}")
    dig = digest(ours_out[0][0]) if name == "all_reduce" and ours_out else None
    return errs, {"algorithm": used, "counts": counts, "digest": dig}


def algorithms(name, comm=None):
    """Every algorithm of `name` that `comm` can run (with "shm" on the shared-memory transport)."""
    return (P.algorithms_for(name, comm) if comm is not None else P.ALGORITHMS[name]) + ["auto"]


def matrix(comm, numels, *, dtype=torch.int64, ops=("sum",), layouts=("contig",), names=None, seed=0,
           group=None, to_global=None, local=None):
    """check_case over names × algorithms × numels × ops × layouts; roots rotate through the ranks.
    Returns (errors, cases) where cases maps a case key to that rank's info dict."""
    errs, cases = [], {}
    n = comm.size
    k = 0
    # all-to-all has its own matrix (tests/test_all_to_all.py): its splits are another axis
    for name in names or [k for k in P.ALGORITHMS if not k.startswith("all_to_all")]:
        for algo in algorithms(name, comm):
            for numel in numels:
                for op in (ops if name in REDUCING else ("sum",)):
                    if op == "avg" and not dtype.is_floating_point:
                        continue
                    for layout in layouts:
                        k += 1
                        root = (k * 3 + 1) % n if name in ROOTED else 0
                        groot = to_global(root) if to_global else root
                        e, info = check_case(comm, name, algo, numel=numel, dtype=dtype, op=op, root=root,
                                             layout=layout, seed=seed + k, group=group, global_root=groot,
                                             local=local)
                        errs += e
                        cases[(name, algo, numel, op, layout, root)] = info
    return errs, cases


# ----------------------------------------------------------------------------- ledger identities
# Evaluated on the collected counts of every rank (in the test process, or on rank 0 under MPI).

def _ceil_log2(n):
    return (n - 1).bit_length()


def _subtree(v, n):
    low = v & -v if v else 1 << n.bit_length()
    return min(low, n - v)


def traffic_identities(name, algo, n, numel, elem, root, counts):
    """Checks on every rank's (msgs_sent, bytes_sent, msgs_recv, bytes_recv) for one call,
    written from the algorithms' descriptions, independently of primitives.engine.cost.traffic."""
    S = numel * elem
    ms = [c[0] for c in counts]
    bs = [c[1] for c in counts]
    mr = [c[2] for c in counts]
    br = [c[3] for c in counts]
    errs = []

    def want(cond, what):
        if not cond:
            errs.append(f"{name}/{algo} N={n} numel={numel} root={root}: {what}; counts={counts}")

    want(sum(ms) == sum(mr) and sum(bs) == sum(br), "messages/bytes sent != received (conservation)")
    if n == 1 or numel == 0:
        want(sum(ms) == 0 and sum(bs) == 0, "a world of one or an empty tensor sends nothing")
        return errs
    base = name.replace("_single", "")
    k = max(1, min(numel, math.ceil(S / PIPELINE_BYTES)))   # pipeline segments
    p2 = 1 << (n.bit_length() - 1)
    rem, lg = n - p2, p2.bit_length() - 1
    others = [r for r in range(n) if r != root]
    if base == "all_reduce":
        if algo == "ring":
            want(sum(bs) == 2 * (n - 1) * S, "Σ bytes == 2(N-1)·S")
            lo, hi = 2 * (n - 1) * (numel // n) * elem, 2 * (n - 1) * -(-numel // n) * elem
            want(all(lo <= b <= hi for b in bs), f"each rank within [{lo}, {hi}] bytes")
            if numel >= n:
                want(all(m == 2 * (n - 1) for m in ms), "each rank 2(N-1) messages")
        elif algo == "shm" and one_shot(S, n):
            want(all(m == n - 1 and b == (n - 1) * S for m, b in zip(ms, bs)), "one-shot: N-1 peers read all S")
        elif algo in ("direct", "shm"):       # shm: peers read what direct would send
            want(sum(bs) == 2 * (n - 1) * S, "Σ bytes == 2(N-1)·S")
            c = [len(x) * elem for x in torch.arange(numel).tensor_split(n)]
            want(all(b == S - c[r] + (n - 1) * c[r] for r, b in enumerate(bs)),
                 "rank r sends every chunk but its own once, then its own chunk to N-1 peers")
            if numel >= n:
                want(all(m == 2 * (n - 1) for m in ms), "each rank 2(N-1) messages")
        elif algo == "one_shot":
            want(all(m == n - 1 and b == (n - 1) * S for m, b in zip(ms, bs)), "each rank sends S to N-1 peers")
        elif algo == "linear":
            want(ms[0] == n - 1 and bs[0] == (n - 1) * S, "rank 0 sends (N-1) × S")
            want(all(ms[r] == 1 and bs[r] == S for r in range(1, n)), "others send S once")
        elif algo == "hierarchical":   # m·2(k-1)·S inside the nodes + 2(m-1)·S across = 2(N-1)·S
            want(sum(bs) == 2 * (n - 1) * S, "Σ bytes == 2(N-1)·S")
        elif algo == "recursive_doubling":
            want(sum(ms) == p2 * lg + 2 * rem and sum(bs) == (p2 * lg + 2 * rem) * S,
                 "Σ = (P·log2 P + 2R) whole-buffer messages")
            want(all(b == m * S for m, b in zip(ms, bs)), "every message is the whole buffer")
        elif algo == "rabenseifner":
            want(sum(bs) == (2 * (p2 - 1) + 2 * rem) * S, "Σ bytes == (2(P-1) + 2R)·S")
            surv = [r for r in range(n) if not (r < 2 * rem and r % 2 == 0)]
            fold = lambda r: S if r < 2 * rem else 0  # noqa: E731
            lo, hi = 2 * (p2 - 1) * (numel // p2) * elem, 2 * (p2 - 1) * -(-numel // p2) * elem
            want(all(lo <= bs[r] - fold(r) <= hi for r in surv), f"survivors send within [{lo}, {hi}] (+S fold)")
            if numel >= p2:
                want(sum(ms) == p2 * 2 * lg + 2 * rem, "Σ msgs == P·2log2 P + 2R")
    elif base == "all_gather":
        if algo in ("ring", "direct", "shm", "hierarchical"):   # hierarchical: (m-1) + m(k-1) = N-1 messages
            want(all(m == n - 1 and b == (n - 1) * S for m, b in zip(ms, bs)), "each rank (N-1) × S")
        else:
            want(ms[0] == (n - 1) ** 2 and bs[0] == (n - 1) ** 2 * S, "rank 0 sends (N-1)² × S")
            want(all(ms[r] == 1 and bs[r] == S for r in range(1, n)), "others send S once")
        want(all(b == (n - 1) * S for b in br), "every rank receives (N-1)·S")
    elif base == "reduce_scatter":
        if algo in ("ring", "direct", "shm", "hierarchical"):   # hierarchical: (m-1) + m(k-1) = N-1 messages
            want(all(m == n - 1 and b == (n - 1) * S for m, b in zip(ms, bs)), "each rank (N-1) × block")
        else:
            want(ms[0] == n - 1 and bs[0] == (n - 1) * S, "rank 0 sends N-1 blocks")
            want(all(ms[r] == 1 and bs[r] == n * S for r in range(1, n)), "others send the whole N·S input")
    elif base == "broadcast":
        want(sum(bs) == (n - 1) * S, "Σ bytes == (N-1)·S")
        want(br[root] == 0 and all(br[r] == S for r in others), "each non-root receives S exactly once")
        if algo == "linear":
            want(ms[root] == n - 1, "root sends N-1 messages")
        elif algo == "tree":
            want(ms[root] == _ceil_log2(n) and sum(ms) == n - 1, "root sends ceil(log2 N), Σ N-1")
        else:
            want(sum(ms) == (n - 1) * k, f"Σ msgs == (N-1)·k, k={k} segments")
    elif base == "reduce":
        want(bs[root] == 0 and all(bs[r] == S for r in others), "every non-root sends S, dst nothing")
        if algo in ("linear", "tree"):
            want(all(ms[r] == 1 for r in others), "one message per non-root")
        else:
            want(all(ms[r] == k for r in others), f"k={k} segments per non-root")
        if algo == "linear":
            want(br[root] == (n - 1) * S, "dst receives (N-1)·S")
        if algo == "tree":
            want(mr[root] == _ceil_log2(n), "dst receives from ceil(log2 N) children")
    elif base in ("scatter", "gather"):
        out_b, out_m = (bs, ms) if base == "scatter" else (br, mr)
        want(out_b[root] == (n - 1) * S, "the root moves (N-1)·S")
        v = [(r - root) % n for r in range(n)]
        if algo == "linear":
            want(sum(ms) == n - 1 and sum(bs) == (n - 1) * S, "Σ = N-1 messages of S")
        elif algo == "ring":
            want(sum(ms) == n * (n - 1) // 2 and sum(bs) == n * (n - 1) // 2 * S, "Σ = N(N-1)/2 blocks")
        else:
            want(sum(ms) == n - 1, "Σ msgs == N-1 (one per tree edge)")
            want(sum(bs) == sum(_subtree(v[r], n) for r in others) * S, "each edge carries its subtree")
            want(out_m[root] == _ceil_log2(n), "root talks to ceil(log2 N) children")
    return errs
