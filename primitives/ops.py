"""What every collective algorithm shares: the chunk rule, the reduce ops, waiting on requests.

    python -m pytest -q tests/test_primitives_units.py -k chunk

chunk_bounds is THE rule for cutting a buffer into N pieces (torch.tensor_split's): tensor
parallelism, ZeRO's shards and the ring's chunks all use it, so a rank's shard is the same
elements everywhere. Reduce ops are strings: "sum", "avg", "product", "min", "max" and the
bitwise "band", "bor", "bxor" (integer and bool tensors); "avg" sums and divides once at the
end (finish_avg_).
"""
import torch

PIPELINE_BYTES = 1 << 20   # chain algorithms (broadcast/reduce "ring") send segments of about this size


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """torch.tensor_split's rule: the first numel % n chunks get one extra element."""
    q, r = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        out.append((start, start + size))
        start += size
    return out


def segments(numel: int, elem_size: int) -> int:
    """k = ceil(S / 1 MiB) segments (at least 1, at most one per element)."""
    return max(1, min(numel, -(-numel * elem_size // PIPELINE_BYTES)))


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """acc <- acc (op) other, in place. AVG is summed here and divided once at the end."""
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "product":
        acc.mul_(other)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    else:                                   # "band" | "bor" | "bxor"
        getattr(acc, {"band": "bitwise_and_", "bor": "bitwise_or_", "bxor": "bitwise_xor_"}[op])(other)


def finish_avg_(t: torch.Tensor, op: str, n: int) -> None:
    """The AVG op's last step: divide the sum by the number of ranks."""
    if op == "avg" and n > 1:
        t.div_(n)


def wait_all(reqs) -> None:
    for r in reqs:
        r.wait()
