"""zero.Init's partitions in a file while the model is built (DeepSpeed's remote_device "nvme").

    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}
    with zero_from_scratch.zero.Init(config_dict_or_path=cfg):
        model = Big()          # each shard goes to its file as soon as it is made: no rank holds Ψ/N
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)   # read back unit by unit
    python -m pytest -q tests/test_zero_init.py -k nvme

One file per rank and Init, NVME_PATH/zero_init_rank{r}_{pid}_{k}.params: every parameter's shard
(⌈numel/N⌉ elements, b bytes each) at its own byte offset; `ds_tensor` is left empty with its
`ds_numel` kept, as DeepSpeed's swapper leaves it. A shard partitioned again (an edit through
GatheredParameters, transformers' _init_weights) is rewritten in place when its size is unchanged,
appended otherwise.
  write      b·⌈numel/N⌉ per partition (once per parameter while building, once more per re-partition)
  read       b·⌈numel/N⌉ per gather (Init's mode, GatheredParameters, initialize's adoption)
  memory     one shard at a time, on top of the module being built (zero_init.py)
Why a file of its own rather than the engine's params.group{g}: Init shards each parameter, the
engine shards each module's flattened parameters (one unit), so rank r's elements differ between
the two; initialize reads each parameter's shard once, all-gathers it and writes this rank's block
of the unit to the engine's home (param_offload.ParamStore), then deletes this file when its last
shard is adopted. Disk: b·Ψ/N here plus b·Ψ/N in the engine's files during initialize.
"""
from __future__ import annotations

import itertools
import os

import torch

from zero_from_scratch.engine.param_offload import file_io

_FILES = itertools.count()


class InitSwap:
    """This rank's file of Init's shards; `put` moves a shard in, `get` reads a copy back."""

    def __init__(self, nvme_path: str, rank: int):
        os.makedirs(nvme_path, exist_ok=True)
        self.path = os.path.join(nvme_path, f"zero_init_rank{rank:03d}_{os.getpid()}_{next(_FILES)}.params")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.end = 0                              # bytes used
        self.live: dict[int, tuple[int, int]] = {}   # id(param) -> (byte offset, bytes)
        self.bytes_written = self.bytes_read = 0

    def put(self, p, shard: torch.Tensor) -> None:
        """shard (p's, from zero_partition.partition) → the file; p.ds_tensor ← empty, ds_numel kept."""
        nbytes = shard.numel() * shard.element_size()
        off, size = self.live.get(id(p), (self.end, -1))
        if size != nbytes:
            off, self.end = self.end, self.end + nbytes
        file_io(True, self.fd, shard.cpu(), off)
        self.bytes_written += nbytes
        self.live[id(p)] = (off, nbytes)
        t = torch.empty(0, dtype=shard.dtype, device=shard.device)
        t.ds_numel = shard.numel()
        p.ds_tensor, p.ds_swap = t, self

    def get(self, p) -> torch.Tensor:
        """A copy of p's shard read from the file (on the shard's device)."""
        off, nbytes = self.live[id(p)]
        t = torch.empty(p.ds_tensor.ds_numel, dtype=p.ds_tensor.dtype)
        file_io(False, self.fd, t, off)
        self.bytes_read += nbytes
        return t.to(p.ds_tensor.device)

    def drop(self, p) -> None:
        """p's shard was adopted by an engine: forget it; the last one closes and deletes the file."""
        self.live.pop(id(p), None)
        p.__dict__.pop("ds_swap", None)
        if not self.live:
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            os.remove(self.path)
            self.fd = None

    def __del__(self):
        self.close()
