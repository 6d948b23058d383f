"""zero_optimization.ignore_unused_parameters = false at ZeRO-1/2 with offload_optimizer (engine/unused_params.py).

    python -m pytest -q tests/test_unused_params.py

2 ranks, ringzero's own initialize, stages 1 and 2, offload_optimizer cpu, 2 micro-batches per step.
A model with a layer that never takes part in the loss: false fails the first optimizer step on
every rank with DeepSpeed's AssertionError naming the key (and never earlier: the micro-step before
the boundary passes); true trains. The check is per step, as DeepSpeed's record is emptied after
each: a layer used in step 1 and unused in step 2 fails step 2. Which backwards count: a layer used
only in micro-batch 0 of each step trains at stage 1 (DeepSpeed's reduce_gradients copies every
accumulated gradient at the boundary) and fails the first step at stage 2 and at stage 1 with
overlap_comm (boundary backward only). Every layer used, false trains and equals an independent
reference: one process, torch's Adam over the ranks' averaged gradients of loss/2 (fp32, no clipping, 1e-6).
"""
import copy

import torch
from torch import nn

import zero_from_scratch


class Net(nn.Module):
    def __init__(self, unused: bool):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.spare = nn.Linear(4, 4) if unused else None
        self.when = "never"                   # in which micro-steps spare takes part in the loss

    def forward(self, x, i=0):
        on = {"never": False, "step 1": i < 2, "micro-batch 0": i % 2 == 0}[self.when]
        h = self.spare(x) if on else x
        return self.b(torch.tanh(self.a(h)))


def _batch(rank, i):
    g = torch.Generator().manual_seed(7 * i + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _train(model, rank, stage, ignore, steps=2, overlap=False):
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                 "ignore_unused_parameters": ignore, "overlap_comm": overlap},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    done = 0
    for i in range(2 * steps):
        x, y = _batch(rank, i)
        engine.backward(((engine(x, i) - y) ** 2).mean())
        try:
            engine.step()
        except AssertionError as e:
            return done, str(e)
        done += 1
    return done, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(rank, world):
    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        out[stage, "unused", False] = _train(Net(True), rank, stage, False)
        out[stage, "unused", True] = _train(Net(True), rank, stage, True)[0]
        net = Net(True)
        net.when = "step 1"
        out[stage, "step 1 only"] = _train(net, rank, stage, False)[0]
        for overlap in (False, True):
            net = Net(True)
            net.when = "micro-batch 0"
            out[stage, "micro-batch 0", overlap] = _train(net, rank, stage, False, overlap=overlap)[0]
        torch.manual_seed(0)
        start = Net(False)
        out[stage, "used", False] = (copy.deepcopy(start), _train(start, rank, stage, False))
    return out


def _reference(start, world=2, steps=2):
    m = copy.deepcopy(start)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(steps):
        grads = [torch.zeros_like(p) for p in m.parameters()]
        for i in (2 * s, 2 * s + 1):
            for r in range(world):
                m.zero_grad()
                x, y = _batch(r, i)
                (((m(x) - y) ** 2).mean() / 2).backward()
                for g, p in zip(grads, m.parameters()):
                    g += p.grad / world
        for g, p in zip(grads, m.parameters()):
            p.grad = g
        opt.step()
    return dict(m.named_parameters())


def test_false_asserts_at_the_step_on_every_rank_and_true_trains(spawn):
    outs = spawn(_run, 2)
    for stage in (1, 2):
        for out in outs:
            done, msg = out[stage, "unused", False]
            assert done == 1, (stage, done)                  # the first step() is no boundary: it passes
            assert "ignore_unused_parameters" in msg and "not used in producing loss" in msg
            assert out[stage, "unused", True] == 4
            assert out[stage, "step 1 only"] == 3, stage            # step 1 passes, step 2 asserts
            assert out[stage, "micro-batch 0", False] == (4 if stage == 1 else 1), stage
            assert out[stage, "micro-batch 0", True] == 1, stage
        start, (done, got) = outs[0][stage, "used", False]
        assert done == 4
        ref = _reference(start)
        for n, p in ref.items():
            for out in outs:
                assert torch.allclose(out[stage, "used", False][1][1][n], p.detach(), rtol=1e-6, atol=1e-7), (stage, n)
