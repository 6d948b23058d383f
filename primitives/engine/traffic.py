"""The exact traffic each algorithm sends: (messages, bytes) per rank, and per link class.

    python -m pytest -q -x tests/test_primitives_units.py -k traffic

`traffic()` is the closed form each algorithm's docstring states (primitives/<collective>.py);
tests compare it with what the ledger counted. `link_traffic()` splits it into intra- and
inter-node messages for m nodes × k ranks (ranks numbered node by node).
"""
from __future__ import annotations

import math

from primitives.engine.shm_collectives import one_shot
from primitives.ops import chunk_bounds, segments


def traffic(name: str, algo: str, n: int, rank: int, numel: int, elem: int, root: int = 0,
            local: int | None = None, *, splits: list[int] | None = None) -> tuple[int, int]:
    """(messages, bytes) that `rank` sends in one call, per the algorithm's docstring.

    numel is the caller's tensor (for reduce_scatter*: the output block; all_gather*: the
    input; all_to_all*: the whole input, split evenly unless `splits` gives the elements sent
    to each rank). Empty messages are never sent, so a zero-sized block costs no message.
    local: ranks per node, nodes numbered in rank blocks (only "hierarchical" depends on it;
    None = one node).
    """
    if name.startswith("all_to_all"):      # both algorithms: every block but my own, once
        blocks = splits if splits is not None else [numel // n] * n
        sizes = [blocks[p] * elem for p in range(n) if p != rank and blocks[p] > 0]
        return len(sizes), sum(sizes)
    if algo == "hierarchical":
        t = link_traffic(name, algo, n, rank, numel, elem, local or n)
        return t["intra"][0] + t["inter"][0], t["intra"][1] + t["inter"][1]
    S = numel * elem
    if n <= 1 or numel == 0:
        return 0, 0
    base = name.replace("_single", "")
    if algo == "shm" and base == "all_reduce" and one_shot(S, n):
        return n - 1, (n - 1) * S                   # shm_collectives one-shot: peers read all of mine
    algo = "direct" if algo == "shm" else algo     # shm_collectives: peers read what "direct" sends
    v = (rank - root) % n
    low = v & -v if v else 1 << n.bit_length()

    def msgs(sizes):
        sizes = [s for s in sizes if s > 0]
        return len(sizes), sum(sizes)

    if base in ("all_gather", "reduce_scatter") or algo in ("linear", "ring", "direct", "one_shot") and base == "all_reduce":
        return msgs([b for _, b in peers(name, algo, n, rank, numel, elem)])

    if base == "broadcast":
        if algo == "linear":
            return msgs([S] * (n - 1)) if v == 0 else (0, 0)
        if algo == "ring":
            return (segments(numel, elem), S) if v < n - 1 else (0, 0)
        return msgs([S] * len(_all_kids(v, n)))
    if base == "reduce":
        if algo in ("linear", "tree"):
            return (0, 0) if v == 0 else (1, S)
        return (segments(numel, elem), S) if rank != root else (0, 0)
    if base == "all_reduce":
        P = 1 << (n.bit_length() - 1)
        rem = n - P                                  # recursive doubling, Rabenseifner: fold to P ranks first
        if rank < 2 * rem and rank % 2 == 0:
            return 1, S
        fold = [S] if rank < 2 * rem else []
        nr = rank // 2 if rank < 2 * rem else rank - rem
        steps = int(math.log2(P))
        if algo == "recursive_doubling":
            return msgs([S] * steps + fold)
        c = [(e - s) * elem for s, e in chunk_bounds(numel, P)]
        halving = [_half_bytes(c, nr, P, i) for i in range(steps)]              # sums to S - c[nr]
        doubling = [sum(c[(nr & ~(m - 1)) + j] for j in range(m)) for m in (1 << i for i in range(steps))]
        return msgs(halving + doubling + fold)
    if base == "scatter":
        if algo == "linear":
            return msgs([S] * (n - 1)) if v == 0 else (0, 0)
        if algo == "ring":
            return msgs([S] * (n - 1 - v))
        size = lambda u: min(u & -u, n - u)  # noqa: E731
        return msgs([size(v + m) * S for m in _all_kids(v, n)])
    if base == "gather":
        if algo == "linear":
            return (0, 0) if v == 0 else (1, S)
        if algo == "ring":
            return (0, 0) if v == 0 else msgs([S] * (n - v))
        return (0, 0) if v == 0 else (1, min(low, n - v) * S)
    raise KeyError(name)


def _all_kids(v: int, n: int) -> list[int]:
    """The children of v in a binomial tree: v+1, v+2, v+4, ... below lowbit(v)."""
    low = v & -v if v else 1 << n.bit_length()
    out, m = [], 1
    while m < low and v + m < n:
        out.append(m)
        m <<= 1
    return out


def _half_bytes(c, nr, P, i):
    """Bytes sent at halving step i (mask P>>(i+1)): the half of my current range I give away."""
    lo, hi, mask = 0, P, P >> 1
    for _ in range(i):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if not nr & mask else (mid, hi)
        mask >>= 1
    mid = (lo + hi) // 2
    give = (mid, hi) if not nr & mask else (lo, mid)
    return sum(c[give[0]:give[1]])


def link_traffic(name: str, algo: str, n: int, rank: int, numel: int, elem: int, local: int) -> dict:
    """{"intra": (messages, bytes), "inter": (messages, bytes)} that `rank` sends, with `local`
    ranks per node (node of rank r = r // local). Derivations:
      hierarchical all-reduce = a ring all-reduce on the k node-mates of the whole buffer (its
        reduce-scatter and all-gather halves) + a ring all-reduce, on the m same-index ranks, of
        the chunk (j+1) mod k this rank owns after the reduce-scatter.
      hierarchical all-gather / reduce-scatter: (m-1) inter messages of one block; m(k-1) intra.
      flat algorithms: each message is intra or inter by its peer (peers() below)."""
    if n % local:
        raise ValueError(f"{local} ranks per node does not divide {n}")
    k, m = local, n // local
    node, j = divmod(rank, k)
    base = name.replace("_single", "")
    S = numel * elem
    if algo == "hierarchical":
        if base == "all_reduce":
            intra = traffic("all_reduce", "ring", k, j, numel, elem)
            own = chunk_bounds(numel, k)[(j + 1) % k]
            inter = traffic("all_reduce", "ring", m, node, own[1] - own[0], elem)
            return {"intra": intra, "inter": inter}
        if base in ("all_gather", "reduce_scatter"):
            if numel == 0:
                return {"intra": (0, 0), "inter": (0, 0)}
            return {"intra": (m * (k - 1), m * (k - 1) * S), "inter": (m - 1, (m - 1) * S)}
        raise KeyError(name)
    out = {"intra": [0, 0], "inter": [0, 0]}
    for peer, b in peers(name, algo, n, rank, numel, elem):
        if b:
            c = out["intra" if peer // k == node else "inter"]
            c[0] += 1
            c[1] += b
    return {key: tuple(v) for key, v in out.items()}


def peers(name: str, algo: str, n: int, rank: int, numel: int, elem: int) -> list[tuple[int, int]]:
    """(peer, bytes) of every message `rank` sends, for the flat all-reduce / all-gather /
    reduce-scatter algorithms (recursive doubling and Rabenseifner: N a power of two)."""
    S, base, r = numel * elem, name.replace("_single", ""), rank
    if base == "all_reduce":
        c = [(e - s) * elem for s, e in chunk_bounds(numel, n)]
        if algo == "linear":
            return [(p, S) for p in range(1, n)] if r == 0 else [(0, S)]
        if algo == "ring":
            nxt = (r + 1) % n
            return ([(nxt, c[i]) for i in range(n) if i != (r + 1) % n]
                    + [(nxt, c[i]) for i in range(n) if i != (r + 2) % n])
        if algo == "direct":
            return [(p, c[p]) for p in range(n) if p != r] + [(p, c[r]) for p in range(n) if p != r]
        if algo == "one_shot":        # the whole buffer to every other rank, any N
            return [(p, S) for p in range(n) if p != r]
        if n & (n - 1):
            raise ValueError("peers(): recursive algorithms are derived for a power-of-two N only")
        steps = n.bit_length() - 1
        if algo == "recursive_doubling":
            return [(r ^ (1 << i), S) for i in range(steps)]
        halving = [(r ^ (n >> (i + 1)), _half_bytes(c, r, n, i)) for i in range(steps)]
        doubling = [(r ^ mk, sum(c[(r & ~(mk - 1)) + jj] for jj in range(mk))) for mk in (1 << i for i in range(steps))]
        return halving + doubling
    if base in ("all_gather", "reduce_scatter"):
        if algo == "ring":
            return [((r + 1) % n, S)] * (n - 1)
        if algo == "direct":
            return [(p, S) for p in range(n) if p != r]
        if base == "all_gather":
            return [(p, S) for p in range(1, n) for _ in range(n - 1)] if r == 0 else [(0, S)]
        return [(p, S) for p in range(1, n)] if r == 0 else [(0, n * S)]
    raise KeyError(name)
