"""PipelineModule(dynamic_shape=True) as DeepSpeed 0.19.8 serves it (pipeline_parallel/engine/draining.py).

    python -m pytest -q tests/test_ds_whole_dynamic_shape.py

Two pipeline stages, micro-batches whose sequence length differs (2, 5, 3, then 4, 1, 6): each boundary
sends its shape before every activation, as DeepSpeed re-sends its meta; gradients come back in the shape
their micro-batch sent. Two train_batch() steps with SGD against one process running the same layers
(fp32; tolerance 1e-6 relative on losses, 1e-6 absolute on weights: the same sums in the same order but
for the 1/m division's place). Without the flag a changing shape still fails the step, naming it.
"""
import pytest
import torch
import torch.nn as nn

from pipeline_parallel.engine import ds_pipe

LENGTHS, M, B = ((2, 5, 3), (4, 1, 6)), 3, 2


def _layers():
    torch.manual_seed(0)
    return [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


def _micro_batches(step):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(B, n, 6, generator=g), torch.randn(B, n, 3, generator=g)) for n in LENGTHS[step]]


def _cfg():
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0}


def _train(dynamic):
    net = ds_pipe.PipelineModule(layers=_layers(), loss_fn=nn.functional.mse_loss, num_stages=2,
                                 partition_method=[3, 2], dynamic_shape=dynamic)
    engine, *_ = ds_pipe.initialize(model=net, model_parameters=[p for p in net.parameters()], config=_cfg())
    try:
        losses = [float(engine.train_batch(iter(_micro_batches(step)))) for step in range(2)]
    except Exception as e:     # the engine's PipelineError, on every rank
        return str(e)
    return losses, {n: p.detach() for n, p in net.named_parameters()}


def _run(rank, world):
    return _train(True), _train(False)


def test_dynamic_shape_equals_one_process(spawn):
    model = nn.Sequential(*_layers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        total = 0.0
        for x, y in _micro_batches(step):
            loss = nn.functional.mse_loss(model(x), y)
            (loss / M).backward()
            total += float(loss.detach()) / M
        opt.step()
        opt.zero_grad()
        losses.append(total)
    ref = dict(model.named_parameters())
    out, refused = zip(*spawn(_run, 2))
    for got, params in out:
        assert got == pytest.approx(losses, rel=1e-6)
        for n, p in params.items():
            torch.testing.assert_close(p, ref[n].detach(), rtol=0, atol=1e-6)
    assert set(out[0][1]) | set(out[1][1]) == set(ref)
    for msg in refused:
        assert "needs one shape for every micro-batch" in msg


class _RaisesAt(nn.Module):
    """Raises in forward on the micro-batch whose sequence length is n (a stage failing mid-step)."""
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        if x.shape[1] == self.n:
            raise RuntimeError(f"layer fails at length {self.n}")
        return x


def _failing(rank, world, where, n):
    layers = _layers()
    layers.insert(where, _RaisesAt(n))
    net = ds_pipe.PipelineModule(layers=layers, loss_fn=nn.functional.mse_loss, num_stages=2,
                                 partition_method=[3, 3], dynamic_shape=True)
    engine, *_ = ds_pipe.initialize(model=net, model_parameters=[p for p in net.parameters()], config=_cfg())
    try:
        engine.train_batch(iter(_micro_batches(0)))
    except Exception as e:
        return str(e)
    return None


@pytest.mark.parametrize("where", [1, 4])       # stage 0 (its activation fails), stage 1 (its gradient)
def test_a_stage_failing_mid_step_is_named_on_every_rank(spawn, where):
    """The second micro-batch (length 5) fails after the first crossed: no hang, no shape read from data."""
    for msg in spawn(_failing, 2, args=(where, 5), timeout=120.0):
        assert msg is not None and "layer fails at length 5" in msg, msg
