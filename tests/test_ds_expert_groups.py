"""Expert-parallel groups and the checks that reduce over them (zero_from_scratch/as_deepspeed/expert_groups.py).

    python -m pytest -q tests/test_ds_expert_groups.py

4 ranks, expert_parallel_size 2. The groups are checked against DeepSpeed's own docstring layout
(E + D: expert-parallel [0,1] [2,3], expert-data-parallel [0,2] [1,3]) by summing each rank's number
over the group it got (a second call for the same size changes nothing, as DeepSpeed's); CheckOverflow against the rule written out here
(an inf on rank 3 in an expert parameter reaches rank 2, its expert group, and no one else unless the
check reduces over the world too), reduced through the served deepspeed.comm.all_reduce (a patch of it
counts the calls); get_weight_norm against torch.linalg.vector_norm, and with an mpu whose tensor-parallel
rank is 0 on every rank (model-parallel rank = rank, as a pipeline's) every rank counts every tensor,
as DeepSpeed's bwc_tensor_model_parallel_rank rule: the sum over the 4 ranks.
"""
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from zero_from_scratch.as_deepspeed import finder


def _run(rank, world):
    finder.install()
    import deepspeed.utils.groups as groups
    from deepspeed.runtime.utils import CheckOverflow, get_weight_norm
    out = {}
    groups._create_expert_and_data_parallel(2)
    groups._create_expert_and_data_parallel(2, use_data_before_expert_parallel_=True)   # a no-op: it exists
    for kind, get in (("ep", groups._get_expert_parallel_group), ("edp", groups._get_expert_data_parallel_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=get("ep_size_2"))
        out[kind] = t.item()
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    p.grad, q.grad = torch.ones(2), torch.full((2,), float("inf") if rank == 3 else 1.0)
    q.allreduce = False                                              # an expert parameter
    import deepspeed.comm as ds_comm
    calls, real = [], ds_comm.all_reduce
    ds_comm.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        out["check"] = CheckOverflow([[p, q]]).check()
    finally:
        ds_comm.all_reduce = real
    out["calls"] = len(calls)
    out["dense_only"] = CheckOverflow([[p]]).check()
    out["by_norm"] = CheckOverflow([[p, q]]).check_using_norm([get_weight_norm([q.grad])], reduce_overflow=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    mpu = SimpleNamespace(get_model_parallel_rank=lambda: rank, get_tensor_model_parallel_rank=lambda: 0,
                          get_model_parallel_group=lambda: dist.group.WORLD)
    out["norm"] = (get_weight_norm([x, 2 * x]), get_weight_norm([x], norm_type=math.inf), x,
                   get_weight_norm([x], mpu=mpu))
    return out


def test_expert_groups_and_overflow_checks_follow_deepspeeds_layout(spawn):
    outs = spawn(_run, 4)
    for rank, o in enumerate(outs):
        assert o["ep"] == {0: 1, 1: 1, 2: 5, 3: 5}[rank]          # [0,1] [2,3]
        assert o["edp"] == {0: 2, 1: 4, 2: 2, 3: 4}[rank]         # [0,2] [1,3]
        assert o["check"] is (rank in (2, 3)) and o["dense_only"] is False
        assert o["calls"] == 1                                     # the expert group's MAX, served
        assert o["by_norm"] is True                                # reduce_overflow: the world too
        l2, linf, x, mp = o["norm"]
        every = torch.stack([out["norm"][2] for out in outs])
        assert math.isclose(mp, torch.linalg.vector_norm(every).item(), rel_tol=1e-6)
        assert math.isclose(l2, math.sqrt(5) * torch.linalg.vector_norm(x).item(), rel_tol=1e-6)
        assert linf == x.abs().max().item()
