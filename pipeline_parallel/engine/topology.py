"""DeepSpeed's process topologies: named axes laid out row-major over the global ranks.

    python -c "from pipeline_parallel.engine.topology import PipeDataParallelTopology as T; print(T(2, 2).get_coord(1))"

ProcessTopology(axes, dims): the last axis varies fastest, so ["pipe", "data"] puts one stage's data
replicas on adjacent ranks (PipeDataParallelTopology); PipeModelDataParallelTopology is ["pipe",
"data", "model"], [pp, dp, mp] — primitives.mesh's layout, which the engine builds from it.
PipelineParallelGrid: DeepSpeed's process grid over a topology (this rank's coordinates, one group
per axis list). Same names and values as deepspeed.runtime.pipe.topology. Cost: a dict of world
entries; the grid creates every group on every rank (new_group is collective).
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product

import torch.distributed as dist


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


def _prime_factors(N):
    """The prime factors of N > 0 in ascending order (DeepSpeed splits a world into pp × dp with them)."""
    if N <= 0:
        raise ValueError("Values must be strictly positive.")
    primes, p = [], 2
    while N != 1:
        while N % p:
            p += 1
        primes.append(p)
        N //= p
    return primes


class PipelineParallelGrid:
    """deepspeed.runtime.pipe.topology.PipelineParallelGrid: the groups of a topology, seen from this rank.
    Without a topology the world's prime factors go alternately to pipe and data, as DeepSpeed does."""

    def __init__(self, topology=None, process_group=None):
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if topology is None:
            pp = dp = 1
            for i, prime in enumerate(_prime_factors(self.world_size)):
                pp, dp = (pp * prime, dp) if i % 2 == 0 else (pp, dp * prime)
            topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = self.slice_parallel_size = max(topology.get_dim("model"), 1)
        assert self._is_grid_valid(), "Invalid Grid"
        self.stage_id, self.data_parallel_id = self.get_stage_id(), self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # every rank creates every group, in the same order (torch's new_group is collective)
        self.ds_model_proc_group, self.ds_model_rank, self.ds_model_world_size = self._mine(
            [sorted(topology.get_axis_list("data", i)) for i in range(self.data_parallel_size)])
        self.dp_groups = topology.get_axis_comm_lists("data")
        self.dp_proc_group, _, _ = self._mine(self.dp_groups)
        self.dp_group = next(g for g in self.dp_groups if self.global_rank in g)
        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        self.pp_proc_group, _, _ = self._mine(self.pipe_groups)
        self.pp_group = next(g for g in self.pipe_groups if self.global_rank in g)
        self.p2p_groups = [[r, g[(g.index(r) + 1) % len(g)]] for r in range(self.world_size)
                           for g in self.pipe_groups if r in g]
        lists = ([[r] for r in range(self.world_size)] if self.model_parallel_size == 1
                 else topology.get_axis_comm_lists("model"))
        self.slice_proc_group, _, _ = self._mine(lists)
        self.slice_group = next(g for g in lists if self.global_rank in g)

    def _mine(self, lists):
        """Create one group per rank list; (this rank's group, its rank in it, its size)."""
        mine = (None, -1, 0)
        for ranks in lists:
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                mine = (group, ranks.index(self.global_rank), len(ranks))
        return mine

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == dist.get_world_size()

    def stage_to_global(self, stage_id, **kwargs) -> int:
        """The global rank of `stage_id` at this rank's other coordinates (kwargs override them)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self):
        return self._topo

    def get_stage_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).pipe

    def get_data_parallel_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).data

    def get_slice_parallel_rank(self):
        return self.slice_group.index(self.global_rank)


# DeepSpeed's getters, each an attribute of the grid (deepspeed.runtime.pipe.topology's names)
for _name, _attr in {"get_global_rank": "global_rank", "get_pipe_parallel_rank": "stage_id",
                     "get_pipe_parallel_world_size": "pipe_parallel_size", "get_pipe_parallel_group": "pp_proc_group",
                     "get_data_parallel_rank": "data_parallel_id", "get_data_parallel_world_size": "data_parallel_size",
                     "get_data_parallel_group": "dp_proc_group", "get_data_parallel_group_ranks": "dp_group",
                     "get_model_parallel_rank": "ds_model_rank", "get_model_parallel_world_size": "ds_model_world_size",
                     "get_model_parallel_group": "ds_model_proc_group",
                     "get_slice_parallel_world_size": "slice_parallel_size",
                     "get_slice_parallel_group": "slice_proc_group"}.items():
    setattr(PipelineParallelGrid, _name, (lambda a: lambda self: getattr(self, a))(_attr))   # one argument: self
del _name, _attr


def mesh_sizes(topo: ProcessTopology) -> tuple[int, int, int]:
    """(pp, dp, tp) of a topology the engine can run: its ranks laid out as primitives.mesh lays them."""
    if topo.axes not in (["pipe", "data"], ["pipe", "data", "model"]):
        raise ValueError(f"topology axes {topo.axes}: the pipeline engine runs DeepSpeed's PipeDataParallelTopology "
                         "(['pipe', 'data']) or PipeModelDataParallelTopology (['pipe', 'data', 'model']) layouts; "
                         "build one of those")
    return topo.get_dim("pipe"), topo.get_dim("data"), max(topo.get_dim("model"), 1)
