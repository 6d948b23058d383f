"""primitives.mesh: the rank layout without processes, then the real groups on 4 ranks."""
import pytest
import torch
import torch.distributed as dist

from primitives.mesh import Layout, Mesh, MeshError


def test_layout_is_a_bijection_with_tp_fastest():
    lay = Layout(dp=2, pp=3, tp=2)
    seen = {lay.rank_of(*lay.coords_of(r)) for r in range(lay.world)}
    assert seen == set(range(12))
    assert lay.coords_of(1) == (0, 0, 1)      # neighbours differ in tp
    assert lay.coords_of(2) == (0, 1, 0)      # then dp
    assert lay.coords_of(4) == (1, 0, 0)      # pp outermost


def test_groups_partition_the_world_along_each_axis():
    lay = Layout(dp=2, pp=2, tp=2)
    for axis, size in (("pp", 2), ("dp", 2), ("tp", 2)):
        groups = lay.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == size for g in groups)
    assert lay.groups("tp")[0] == [0, 1]
    assert lay.groups("dp")[0] == [0, 2]
    assert lay.groups("pp")[0] == [0, 4]


def test_deepspeed_pipe_data_layout_when_tp_is_1():
    # DeepSpeed's PipeDataParallelTopology(num_pp=2, num_dp=2): stage 0 = ranks 0, 1
    lay = Layout(dp=2, pp=2)
    assert [lay.coords_of(r)[0] for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("bad", [dict(dp=0), dict(tp=-1), dict(pp=1.5)])
def test_bad_axis(bad):
    with pytest.raises(MeshError, match="positive int"):
        Layout(**bad)


def test_mesh_must_factor_the_world():
    with pytest.raises(MeshError, match="does not factor the world size 6"):
        Layout(dp=2, tp=2).check(6, rank=3)


def _groups_sum(rank, world):
    mesh = Mesh.build(dp=2, tp=2)
    out = {}
    for axis in ("dp", "tp", "pp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.group(axis))
        out[axis] = (t.item(), mesh.members[axis])
    return mesh.coords, out


def test_mesh_groups_on_four_ranks(spawn):
    res = spawn(_groups_sum, 4)
    lay = Layout(dp=2, tp=2)
    for r, (coords, out) in enumerate(res):
        assert coords == lay.coords_of(r)
        for axis, (total, members) in out.items():
            assert r in members
            assert total == sum(members), (r, axis)


def _bad_mesh(rank, world):
    Mesh.build(dp=3, tp=1)


def test_bad_mesh_errors_on_every_rank(spawn):
    res = spawn(_bad_mesh, 2, allow_fail=True)
    for r, (status, text) in enumerate(res):
        assert status == "error" and f"rank {r}: mesh dp=3" in text
