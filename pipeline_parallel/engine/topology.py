"""DeepSpeed's process topologies: named axes laid out row-major over the global ranks.

    python -c "from pipeline_parallel.engine.topology import PipeDataParallelTopology as T; print(T(2, 2).get_coord(1))"

ProcessTopology(axes, dims): the last axis varies fastest, so axes=["pipe", "data"] puts the data
replicas of one stage on adjacent ranks (DeepSpeed's PipeDataParallelTopology);
PipeModelDataParallelTopology is axes ["pipe", "data", "model"], dims [pp, dp, mp] — the layout of
primitives.mesh (global rank = (pp·dp + dp)·tp + tp), which the engine builds from it.
Same method names and return values as deepspeed.runtime.pipe.topology. Cost: a dict of world entries.
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product


class ProcessTopology:
    def __init__(self, axes, dims):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology needs distinct axes, one dim each; got axes={axes} dims={dims}")
        if any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"ProcessTopology dims must be positive ints, got {dims}")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {self.ProcessCoord(*c): r for r, c in enumerate(product(*[range(d) for d in dims]))}

    def get_rank(self, **coord_kwargs) -> int:
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"key {coord_kwargs} invalid for topology axes={self.axes} dims={self.dims}")
        return self.mapping[key]

    def get_axis_names(self):
        return self.axes

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in set(omit_axes))

    def get_dim(self, axis) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank):
        for coord, idx in self.mapping.items():
            if idx == rank:
                return coord
        raise ValueError(f"rank {rank} not found in topology.")

    def get_axis_comm_lists(self, axis):
        """Lists of ranks that differ only in `axis` (one communicator group each)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        return [[self.mapping[self.ProcessCoord(**dict(zip(others, c)), **{axis: i})] for i in range(self.get_dim(axis))]
                for c in product(*[range(self.get_dim(a)) for a in others])]

    def filter_match(self, **filter_kwargs):
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis, idx):
        i = self.axes.index(axis)
        return [r for c, r in self.mapping.items() if c[i] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self):
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline outermost, data replicas adjacent (gradient all-reduce on the fast links)."""

    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data, tensor ("model") parallel; tensor-parallel ranks adjacent."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def mesh_sizes(topo: ProcessTopology) -> tuple[int, int, int]:
    """(pp, dp, tp) of a topology the engine can run: its ranks laid out as primitives.mesh lays them."""
    if topo.axes not in (["pipe", "data"], ["pipe", "data", "model"]):
        raise ValueError(f"topology axes {topo.axes}: the pipeline engine runs DeepSpeed's PipeDataParallelTopology "
                         "(['pipe', 'data']) or PipeModelDataParallelTopology (['pipe', 'data', 'model']) layouts; "
                         "build one of those")
    return topo.get_dim("pipe"), topo.get_dim("data"), max(topo.get_dim("model"), 1)
