"""The one process-group mesh of ringzero: data × pipeline × tensor parallelism.

    python -m pytest -q tests/test_mesh.py
    mesh = primitives.mesh.Mesh.build(dp=2, pp=2, tp=2)   # on every rank, after init
    mesh.dp_group, mesh.pp_group, mesh.tp_group          # torch process groups (None = world)
    mesh.coords                                          # this rank's (pp, dp, tp) indices
    mesh.mpu()                                           # DeepSpeed's mpu protocol (dp and tp groups)

Layout (the order Megatron-LM and torchtitan use): tensor-parallel ranks are adjacent (they
talk every layer, so they should share a node), data-parallel next, pipeline stages outermost:

    global rank = (pp_index · dp + dp_index) · tp + tp_index

With tp = 1 this is DeepSpeed's PipeDataParallelTopology (axes [pipe, data], data fastest),
so our pipeline engine and DeepSpeed's put the same rank on the same stage.

Cost: building the mesh creates (dp·tp + pp·tp + pp·dp) groups; torch requires every rank to
create every group in the same order, so `build` is collective and must run on all ranks.
Pure layout logic (`coords_of`, `rank_of`, `groups`) needs no processes and is unit-tested.
"""
from dataclasses import dataclass, field

import torch.distributed as dist

AXES = ("pp", "dp", "tp")


class MeshError(ValueError):
    """A mesh that does not factor the world, or a non-positive axis."""


@dataclass(frozen=True)
class Layout:
    """The rank layout alone (no processes): sizes of each axis and the world they factor."""
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or v < 1:
                raise MeshError(f"mesh axis {axis} must be a positive int, got {v!r}")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def check(self, world_size: int, rank: int | None = None) -> None:
        if self.world != world_size:
            who = f"rank {rank}: " if rank is not None else ""
            raise MeshError(f"{who}mesh dp={self.dp} × pp={self.pp} × tp={self.tp} = {self.world} "
                            f"does not factor the world size {world_size}")

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) indices of a global rank."""
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return pp, dp, tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: ranks that differ only in that coordinate, in axis order."""
        if axis not in AXES:
            raise MeshError(f"unknown mesh axis {axis!r}; expected one of {AXES}")
        size = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        a, b = [x for x in AXES if x != axis]
        return [[self.rank_of(**{a: i, b: j, axis: k}) for k in range(size[axis])]
                for i in range(size[a]) for j in range(size[b])]


@dataclass
class Mesh:
    """A Layout bound to this process: its coordinates and the groups it belongs to."""
    layout: Layout
    rank: int
    coords: tuple[int, int, int]
    groups: dict = field(default_factory=dict)      # axis -> torch group (None when the axis spans the world)
    members: dict = field(default_factory=dict)     # axis -> global ranks of this rank's group

    @classmethod
    def build(cls, dp: int = 1, pp: int = 1, tp: int = 1) -> "Mesh":
        layout = Layout(dp=dp, pp=pp, tp=tp)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        layout.check(world, rank)
        mesh = cls(layout, rank, layout.coords_of(rank))
        for axis in AXES:
            for members in layout.groups(axis):
                # every rank creates every group, in the same order (torch's rule)
                grp = None if len(members) == world else dist.new_group(members)
                if rank in members:
                    mesh.groups[axis], mesh.members[axis] = grp, members
        return mesh

    def group(self, axis: str):
        """The torch group of this rank along `axis` (None = the world group)."""
        return self.groups[axis]

    @property
    def pp_group(self):
        return self.groups["pp"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def tp_group(self):
        return self.groups["tp"]

    def index(self, axis: str) -> int:
        return self.coords[AXES.index(axis)]

    def mpu(self) -> "MeshMPU":
        """DeepSpeed's model-parallel unit over this mesh: data parallel = the dp axis, model
        parallel = the tp axis (what deepspeed.initialize(mpu=) and zero_from_scratch.initialize
        (mpu=) read; ZeRO then shards over the dp group)."""
        return MeshMPU(self)


class MeshMPU:
    """get_{data,model}_parallel_{group,rank,world_size}: the dp and tp axes of a Mesh.

    Groups are always explicit: an axis spanning the world is dist.group.WORLD, never None,
    because DeepSpeed reads an mpu's None as "no such parallelism" (deepspeed.comm.pg_utils.
    is_parallel) and would then skip the tp all-reduce of the gradient norm at dp = 1."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def get_data_parallel_group(self):
        return _explicit(self.mesh.dp_group)

    def get_data_parallel_rank(self) -> int:
        return self.mesh.index("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.layout.dp

    def get_model_parallel_group(self):
        return _explicit(self.mesh.tp_group)

    def get_model_parallel_rank(self) -> int:
        return self.mesh.index("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.layout.tp


def _explicit(group):
    """torch's None (= the world) as the world group object itself."""
    return dist.group.WORLD if group is None else group
