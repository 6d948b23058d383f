"""Pipeline parity: every schedule against one process (fp32, 1e-5; see parity/pipeline.py
for why that tolerance) and against DeepSpeed's pipeline engine, plus what the schedules cost in
stored activations. The default suite runs a representative subset in three spawns; the full
N = 2, 3, 4 × schedule × DeepSpeed sweep is @slow."""
import pytest
import torch
import torch.nn as nn

from parity import pipeline as parity
from pipeline_parallel.executor import Executor
from pipeline_parallel.schedules import build
from primitives import get_comm
from primitives.engine.strict import set_strict_p2p

TOL = 1e-5
B = 2          # micro-batch size


def _check(result_per_rank, n_layers, dp, m, steps, clip, norm_layers=None):
    ref_losses, ref_params = parity.reference(n_layers, dp, m, B, steps, clip, norm_layers=norm_layers)
    losses, params = parity.merge(result_per_rank)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, (losses, ref_losses)
    assert parity.max_diff(params, ref_params) < TOL
    for r in result_per_rank:                        # every rank reports the same mean loss
        assert r["losses"] == losses


def test_every_schedule_equals_one_process_on_two_stages(spawn):
    """pp = 2: naive, GPipe, 1F1B (with global-norm clipping that bites), interleaved v = 2 (4
    chunks), and 1F1B with activation checkpointing; tied embedding/head across the two stages."""
    runs = [dict(n_layers=4, pp=2, m=4, b=B, steps=1, clip=0.0, schedule=s) for s in ("naive", "gpipe")]
    runs += [dict(n_layers=4, pp=2, m=4, b=B, steps=2, clip=0.05, schedule="1f1b"),
             dict(n_layers=6, pp=2, m=4, b=B, steps=2, clip=0.0, schedule="interleaved", v=2),
             dict(n_layers=4, pp=2, m=8, b=B, steps=1, clip=0.0, schedule="gpipe"),
             dict(n_layers=4, pp=2, m=8, b=B, steps=1, clip=0.0, schedule="1f1b"),
             dict(n_layers=4, pp=2, m=8, b=B, steps=1, clip=0.0, schedule="1f1b", ckpt=1)]
    out = spawn(parity.ours_many, 2, args=(runs,))
    for i, r in enumerate(runs):
        _check([o[i] for o in out], r["n_layers"], 1, r["m"], r["steps"], r["clip"])
    # stored activations at m = 4p: GPipe keeps all 8 micro-batches, 1F1B at most p = 2 on stage 0
    gpipe, ofob, ckpt = (out[0][i]["peak_act"] for i in (4, 5, 6))
    assert ofob <= 0.6 * gpipe and ofob == pytest.approx(gpipe * 2 / 8, rel=0.05), (gpipe, ofob)
    assert ckpt < 0.5 * ofob, (ofob, ckpt)          # checkpointing keeps only each layer's input


def test_three_and_four_stages_and_pp_x_dp(spawn):
    """pp = 4 (1F1B, m = 5 not a multiple of 4, uneven 'parameters' split), pp = 2 × dp = 2
    (GPipe), in one 4-rank spawn."""
    runs = [dict(n_layers=4, pp=4, m=5, b=B, steps=2, clip=0.05, schedule="1f1b"),
            dict(n_layers=4, pp=2, m=3, b=B, steps=2, clip=0.05, schedule="gpipe")]
    out = spawn(parity.ours_many, 4, args=(runs,))
    _check([o[0] for o in out], 4, 1, 5, 2, 0.05)
    _check([o[1] for o in out], 4, 2, 3, 2, 0.05)


def test_equals_deepspeed_pipeline_engine(spawn):
    """DeepSpeed's PipelineModule + train_batch (gloo, CPU) on the same layers, partition and
    micro-batches equals one process — and so equals ours — within 1e-5, without clipping. With
    clipping DeepSpeed 0.19.8 (fp32, no ZeRO) differs: its clip_grad_norm_ sums the norms of
    model-parallel rank 0 only, which in a pipeline grid is stage 0; the reference reproduces
    that when told to clip by the first stage's layers' norm, and so does our engine under
    "pipeline": {"clip_norm": "stage0"}."""
    pytest.importorskip("deepspeed")
    out = spawn(parity.deepspeed_side, 2, args=(4, 2, 4, B, 2, 0.0), timeout=600)
    assert out[0]["parts"] == [0, 3, 7]
    _check(out, 4, 1, 4, 2, 0.0)
    out = spawn(parity.deepspeed_side, 2, args=(4, 2, 4, B, 2, 0.05), timeout=600)
    with pytest.raises(AssertionError):
        _check(out, 4, 1, 4, 2, 0.05)                  # the global-norm reference: DeepSpeed differs
    _check(out, 4, 1, 4, 2, 0.05, norm_layers=[0, 1, 2])   # stage 0's layers: equal
    ours = spawn(parity.ours, 2, args=(4, 2, 4, B, 2, 0.05, "1f1b"), kwargs={"clip_norm": "stage0"})
    _check(ours, 4, 1, 4, 2, 0.05, norm_layers=[0, 1, 2])  # pipeline.clip_norm "stage0": DeepSpeed's rule, ours
    assert max(abs(a - b) for a, b in zip(ours[0]["losses"], out[0]["losses"])) < TOL   # equal to DeepSpeed's


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _textbook_executor(rank, world, schedule, m):
    """The textbook executor alone (no engine): stage s runs layers parts[s]:parts[s+1] of one MLP."""
    parts = [0, 3, 5]
    chunk = _mlp()[parts[rank]:parts[rank + 1]]
    opt = torch.optim.SGD(chunk.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    xs = {i: torch.randn(4, 6, generator=g) for i in range(m)}
    ys = {i: torch.randint(0, 3, (4,), generator=g) for i in range(m)}
    ex = Executor(get_comm(), rank, world, [chunk], nn.functional.cross_entropy, m, optimizer=opt)
    losses = [ex.run(build(schedule, rank, world, m), xs, ys) for _ in range(2)]
    return losses, [p.detach().clone() for p in chunk.parameters()]


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_textbook_executor_equals_one_process(spawn, schedule):
    """Two stages of an MLP, 4 micro-batches, two SGD steps: the same loss sums and weights as one
    process accumulating the micro-batches' mean loss."""
    m = 4
    out = spawn(_textbook_executor, 2, args=(schedule, m))
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 6, generator=g) for _ in range(m)]
    ys = [torch.randint(0, 3, (4,), generator=g) for _ in range(m)]
    for step in range(2):
        total = 0.0
        for x, y in zip(xs, ys):
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / m).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        assert out[1][0][step] == pytest.approx(total, abs=1e-6) and out[0][0][step] == 0.0
    ref = [p.detach() for p in model.parameters()]
    ours = out[0][1] + out[1][1]
    assert max(float((a - b).abs().max()) for a, b in zip(ours, ref)) < 1e-6


def _strict_runs(rank, world, runs):
    set_strict_p2p(True)              # nccl's per-peer ordering, replayed over gloo
    return parity.ours_many(rank, world, runs)


STRICT_RUNS = [dict(n_layers=4, pp=2, m=4, b=B, steps=1, clip=0.0, schedule=s) for s in ("naive", "gpipe", "1f1b")]
STRICT_RUNS += [dict(n_layers=6, pp=2, m=4, b=B, steps=1, clip=0.0, schedule="interleaved", v=2)]


def test_nccl_ordering_under_strict_mode(spawn):
    """Strict mode replays nccl's in-order point-to-point streams: the raw 1F1B order would hang
    there, so the engine runs engine/simulator.py's order (train and eval) for every schedule
    at pp = 2 — and still equals one process."""
    out = spawn(_strict_runs, 2, args=(STRICT_RUNS,))
    for i, r in enumerate(STRICT_RUNS):
        _check([o[i] for o in out], r["n_layers"], 1, r["m"], r["steps"], r["clip"])


@pytest.mark.slow
def test_nccl_ordering_under_strict_mode_pp2_dp2(spawn):
    """pp × dp = 2 × 2, every schedule: the boundary messages of both replicas and the gradient
    all-reduce over dp keep nccl's per-peer order, equal to one process at dp = 2."""
    out = spawn(_strict_runs, 4, args=(STRICT_RUNS,))
    for i, r in enumerate(STRICT_RUNS):
        _check([o[i] for o in out], r["n_layers"], 2, r["m"], r["steps"], r["clip"])


SWEEP = [(pp, s, v) for pp in (2, 3, 4) for s in ("naive", "gpipe", "1f1b", "interleaved")
         for v in ((2,) if s == "interleaved" else (1,))]


@pytest.mark.slow
@pytest.mark.parametrize("pp,schedule,v", SWEEP)
def test_sweep_vs_one_process(spawn, pp, schedule, v):
    m = 2 * pp if schedule == "interleaved" else pp + 1
    n_layers = 2 * pp * v - 2 if schedule == "interleaved" else 4
    out = spawn(parity.ours, pp, args=(n_layers, pp, m, B, 2, 0.05, schedule, v))
    _check(out, n_layers, 1, m, 2, 0.05)


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp", [(3, 1), (4, 1), (2, 2)])
def test_sweep_vs_deepspeed(spawn, pp, dp):
    pytest.importorskip("deepspeed")
    out = spawn(parity.deepspeed_side, pp * dp, args=(4, pp, 4, B, 2, 0.0), timeout=600)
    _check(out, 4, dp, 4, 2, 0.0)
