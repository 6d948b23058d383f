"""engine.no_sync() as DeepSpeed 0.19.8's (runtime/engine.py no_sync): backwards inside keep their
gradients on each rank, the next backward outside reduces the sum, step() inside and reentry are
errors, stages 2-3 refuse it with DeepSpeed's words.

Reference: one process on both ranks' data — the step after `with no_sync(): backward(a)` then
`backward(b)` must equal Adam on the mean over ranks of grad(a) + grad(b) (1e-6: a different summation
order); inside the context safe_get_full_grad is this rank's own gradient, as DeepSpeed's param.grad."""
import pytest
import torch
import torch.nn as nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(i, rank):
    g = torch.Generator().manual_seed(10 * i + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _reference(world):
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    loss = sum(nn.functional.mse_loss(m(x), y) for i in (0, 1) for x, y in [_data(i, r) for r in range(world)])
    (loss / world).backward()
    opt.step()
    local = _model()          # rank 0's own gradient of its first micro-batch
    nn.functional.mse_loss(local(_data(0, 0)[0]), _data(0, 0)[1]).backward()
    return {n: p.detach() for n, p in m.named_parameters()}, local[0].weight.grad


def _run(rank, world):
    import zero_from_scratch
    from zero_from_scratch.engine.safe_api import safe_get_full_grad
    out = {}
    for stage, overlap in ((0, False), (1, False), (1, True)):
        cfg = {"train_batch_size": 4 * world, "gradient_clipping": 0.0, "optimizer": {"type": "Adam",
               "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage, "overlap_comm": overlap}}
        e, *_ = zero_from_scratch.initialize(model=_model(), config=cfg)
        with e.no_sync():
            x, y = _data(0, rank)
            e.backward(nn.functional.mse_loss(e(x), y))
            inside = safe_get_full_grad(e.module[0].weight)
            errs = []
            for bad in (e.step, lambda: e.no_sync().__enter__()):
                try:
                    bad()
                except AssertionError as err:
                    errs.append(str(err))
        x, y = _data(1, rank)
        e.backward(nn.functional.mse_loss(e(x), y))
        e.step()
        out[stage, overlap] = ({n: p.detach().clone() for n, p in e.module.named_parameters()}, inside, errs)
    e, *_ = zero_from_scratch.initialize(model=_model(), config={"train_batch_size": 4 * world,
                                                                  "zero_optimization": {"stage": 2}})
    try:
        e.no_sync().__enter__()
    except AssertionError as err:
        out["refused"] = str(err)
    return out


def test_no_sync_accumulates_locally_and_the_next_backward_reduces_the_sum(spawn):
    res = spawn(_run, 2)
    ref, local0 = _reference(2)
    for rank, out in enumerate(res):
        for key in ((0, False), (1, False), (1, True)):
            got, inside, errs = out[key]
            assert max(float((got[n] - ref[n]).abs().max()) for n in ref) < 1e-6, (rank, key)
            if rank == 0:
                assert torch.allclose(inside, local0, atol=1e-7), key
            assert errs == ["It is illegal to call Engine.step() inside no_sync context manager",
                            "no_sync context manager reentry is unsupported"]
        assert out["refused"] == ("no_sync context manager is incompatible with gradient partitioning logic of "
                                  "ZeRO stage 2")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
