"""deepspeed.pipe's surface on our engine: topologies equal to DeepSpeed's own (no processes),
PipelineModule as an nn.Module with per-stage counts, and initialize() the way DeepSpeed's pipeline
example calls it (model_parameters from net.parameters(), training_data, train_batch() returning a
tensor) against one process running the same layers."""
import argparse
import json
import os

import pytest
import torch
import torch.nn as nn

from pipeline_parallel.engine import ds_pipe
from pipeline_parallel.engine.module import PartitionError

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.mark.parametrize("topo", [("PipeDataParallelTopology", (2, 3)), ("PipeModelDataParallelTopology", (2, 2, 2)),
                                  ("ProcessTopology", (["x", "y", "z"], [2, 1, 3]))])
def test_topologies_equal_deepspeeds(topo):
    from deepspeed.runtime.pipe import topology as ds   # the reference: DeepSpeed's own classes
    name, args = topo
    ours, theirs = getattr(ds_pipe, name)(*args), getattr(ds, name)(*args)
    assert ours.get_axis_names() == theirs.get_axis_names() and ours.world_size() == theirs.world_size()
    for r in range(ours.world_size()):
        assert tuple(ours.get_coord(r)) == tuple(theirs.get_coord(r))
        assert ours.get_rank(**ours.get_coord(r)._asdict()) == r
        assert ours.get_rank_repr(r) == theirs.get_rank_repr(r)
        assert ours.get_rank_repr(r, omit_axes=[]) == theirs.get_rank_repr(r, omit_axes=[])
    for ax in ours.get_axis_names() + ["nope"]:
        assert ours.get_axis_comm_lists(ax) == theirs.get_axis_comm_lists(ax)
        assert ours.get_dim(ax) == theirs.get_dim(ax)
    ax = ours.get_axis_names()[0]
    assert ours.filter_match(**{ax: 1}) == theirs.filter_match(**{ax: 1})
    assert ours.get_axis_list(ax, 0) == theirs.get_axis_list(ax, 0)


@pytest.mark.parametrize("cls", ["TrainSchedule", "InferenceSchedule", "DataParallelSchedule"])
def test_schedules_equal_deepspeeds_step_for_step(cls):
    """deepspeed.runtime.pipe.schedule as the runner serves it (ringzero's 1F1B on DeepSpeed's clock):
    every step's instructions, buffers included, equal DeepSpeed's own for p ≤ 5, m ≤ 9, every stage."""
    from deepspeed.runtime.pipe import schedule as ds
    from pipeline_parallel.engine import ds_schedule as ours
    for p in range(1, 6):
        for m in range(1, 10):
            for s in range(p):
                a, b = getattr(ours, cls)(m, p, s), getattr(ds, cls)(m, p, s)
                assert [repr(x) for x in a] == [repr(x) for x in b], (cls, m, p, s)
                assert a.num_pipe_buffers() == b.num_pipe_buffers()


def test_partition_helpers_equal_deepspeeds():
    import random
    from deepspeed.runtime import utils as ds
    from pipeline_parallel.partition import balanced, uniform
    from zero_from_scratch.as_deepspeed.utils import call_to_str, prefix_sum_inc
    rng = random.Random(0)
    for _ in range(500):
        n, k = rng.randint(0, 10), rng.randint(1, 5)
        w = [rng.randint(0, 9) for _ in range(n)]
        assert balanced(w, k) == list(ds.partition_balanced(w, k)) and uniform(n, k) == list(ds.partition_uniform(n, k))
        assert prefix_sum_inc(w) == ds.prefix_sum_inc(w)
    assert call_to_str("f", 1, "x", k=[2]) == ds.call_to_str("f", 1, "x", k=[2]) == "f(1, 'x', k=[2])"


def test_counts_partition_and_nn_module_on_one_stage():
    layers = [nn.Linear(4, 4) for _ in range(5)]
    assert ds_pipe.PipelineModule(layers, num_stages=2, partition_method=[3, 2]).parts == [0, 3, 5]
    assert ds_pipe.PipelineModule(layers, num_stages=2, partition_method=[0, 1, 5]).parts == [0, 1, 5]
    with pytest.raises(PartitionError, match="per-stage layer counts summing to 5"):
        ds_pipe.PipelineModule(layers, num_stages=2, partition_method=[3, 3])
    with pytest.raises(PartitionError, match="empty"):
        ds_pipe.PipelineModule(layers, num_stages=2, partition_method=[5, 0])
    with pytest.raises(RuntimeError, match="must provide num_stages or topology"):
        ds_pipe.PipelineModule(layers)
    net = ds_pipe.PipelineModule(layers, topology=ds_pipe.PipeDataParallelTopology(1, 1))
    assert isinstance(net, nn.Module) and net.num_stages == 1
    names = [n for n, _ in net.named_parameters()]
    assert names[:2] == ["0.weight", "0.bias"] and len(names) == 10          # DeepSpeed's parameter names
    x = torch.randn(3, 4)
    assert torch.equal(net(x), nn.Sequential(*layers)(x))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        list(ds_pipe.PipelineModule(layers, num_stages=2).parameters())


def test_config_sources_follow_deepspeed(tmp_path):
    cfg = {"train_batch_size": 4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert ds_pipe.resolve_config(None, None, cfg) is cfg                       # config_params: config's old name
    assert ds_pipe.resolve_config(argparse.Namespace(deepspeed_config=str(path)), None, None) == str(path)
    with pytest.raises(ValueError, match="Not sure how to proceed"):
        ds_pipe.resolve_config(argparse.Namespace(deepspeed_config=str(path)), cfg, None)
    with pytest.raises(ValueError, match="is required"):
        ds_pipe.resolve_config(argparse.Namespace(deepspeed_config=None), None, None)


M, B = 3, 2


def _mlp_layers():
    torch.manual_seed(0)
    return [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]


def _dataset():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))


def _deepspeed_way(rank, world):
    net = ds_pipe.PipelineModule(layers=_mlp_layers(), loss_fn=nn.functional.cross_entropy, num_stages=2,
                                 partition_method=[3, 2])
    params = [p for p in net.parameters() if p.requires_grad]                   # before initialize, as the example
    args = argparse.Namespace(deepspeed_config=None, local_rank=rank)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "gradient_clipping": 0.0}
    engine, opt, loader, _ = ds_pipe.initialize(args=args, model=net, model_parameters=params, training_data=_dataset(),
                                                config_params=cfg)
    before = [p.detach().clone() for p in params]
    losses = [engine.train_batch() for _ in range(2)]
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in losses)
    moved = all(not torch.equal(a, p) for a, p in zip(before, params))          # the parameters we were given train
    ev = engine.eval_batch()
    return [float(x) for x in losses], float(ev), moved, len(loader), {n: p.detach() for n, p in net.named_parameters()}


def test_initialize_the_deepspeed_way_equals_one_process(spawn):
    out = spawn(_deepspeed_way, 2)
    model = nn.Sequential(*_mlp_layers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = list(torch.utils.data.DataLoader(_dataset(), batch_size=B))
    losses = []
    for step in range(2):
        total = 0.0
        for x, y in data[step * M:(step + 1) * M]:
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / M).backward()
            total += float(loss.detach()) / M
        opt.step()
        opt.zero_grad()
        losses.append(total)
    with torch.no_grad():
        ev = sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in data[2 * M:3 * M]) / M
    for rank in range(2):
        got, got_ev, moved, n_batches, _ = out[rank]
        assert moved and n_batches == 20
        assert got == pytest.approx(losses, rel=1e-6) and got_ev == pytest.approx(ev, rel=1e-6)
    ref = dict(model.named_parameters())
    for rank in range(2):
        for n, p in out[rank][4].items():                                      # "3.weight" = layer 3 on stage 1
            torch.testing.assert_close(p, ref[n].detach(), rtol=1e-5, atol=1e-6)
    assert set(out[0][4]) | set(out[1][4]) == set(ref)
