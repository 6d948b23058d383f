"""Alias: the chunk rule's home is primitives/ops.py (chunk_bounds); this name keeps imports of
`primitives.algos.chunk_bounds` working."""
from primitives.ops import PIPELINE_BYTES, chunk_bounds, segments  # noqa: F401
