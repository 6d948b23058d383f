"""Under the runner the ZeRO engine's collectives are calls of deepspeed.comm's names (as_deepspeed/comm_names.py).

    python -m pytest -q tests/test_ds_served_comm.py

2 ranks (gloo), `import deepspeed` served by ringzero, the script patches deepspeed.comm's
reduce_scatter_fn / all_reduce / all_gather_into_tensor / allgather_fn to count, as DeepSpeed's own tests do. Checked:
ACC backwards (set_gradient_accumulation_boundary on the last, gradient_accumulation_steps 1), one step.
- ZeRO-2: every backward reduce-scatters each unit through reduce_scatter_fn (units × backwards calls,
  each input the unit's padded bucket); inside engine.coalesce_grad_reduction() the block's one flush
  does (units calls). ZeRO-3: the same for its gradient units, and its parameter gathers go through
  allgather_fn, never all_gather_into_tensor (DeepSpeed's partition_parameters.py calls the first). A unit over comm.RS_PIECE_BYTES per rank goes as its pieces, each a
  list-form reduce_scatter, and sums right.
- the calls are the real ones: the weights after the step equal, bit for bit, ringzero's own entry point
  (zero_from_scratch.initialize, which never calls these names) and, within fp32 rounding, SGD in one
  process on the mean of both ranks' gradients (the independent reference; tolerance 1e-6 absolute on
  weights ~0.3: a reduction order apart, ~1e-7 measured).
"""
import functools

import torch
import torch.nn as nn

MB, ACC, LR = 4, 2, 0.5
NAMES = ("reduce_scatter_fn", "all_reduce", "all_gather_into_tensor", "allgather_fn", "reduce_scatter")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(micro, rank):
    g = torch.Generator().manual_seed(10 * micro + rank)
    return torch.randn(MB, 6, generator=g), torch.randn(MB, 3, generator=g)


def _config(stage):
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
            "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": LR}}}


def _train(init, stage, rank, coalesce=False, counts=None):
    m = _model()
    engine, *_ = init(model=m, model_parameters=m.parameters(), config=_config(stage))
    units = [u.padded for u in engine.layout.units]
    if counts is not None:
        counts["on"] = True
    block = engine.coalesce_grad_reduction() if coalesce else _Null()
    with block:
        for k in range(ACC):
            x, y = _batch(k, rank)
            engine.set_gradient_accumulation_boundary(k == ACC - 1)    # as DeepSpeed's test: ACC backwards, one step
            engine.backward(nn.functional.mse_loss(engine(x), y))
    if counts is not None:
        counts["on"] = False
    engine.step()
    from zero_from_scratch.engine.safe_api import safe_get_full_fp32_param
    return units, [safe_get_full_fp32_param(p).clone() for p in m.parameters()]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _ranks(rank, world):
    import zero_from_scratch
    own = {(s, c): _train(zero_from_scratch.initialize, s, rank, c)[1] for s in (2, 3) for c in (False, True)}
    from zero_from_scratch.as_deepspeed import finder
    finder.install()
    import deepspeed
    import deepspeed.comm as dist
    counts, seen = {"on": False}, []

    def counting(name, real):
        def call(*a, **k):
            if counts["on"]:
                counts[name] = counts.get(name, 0) + 1
                seen.append((name, a[1].numel() if name == "reduce_scatter_fn" else 0))
            return real(*a, **k)
        return call
    for n in NAMES:
        setattr(dist, n, counting(n, getattr(dist, n)))
    counted_rs = dist.reduce_scatter_fn

    def reduce_scatter_fn(output_tensor, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, prof=False,
                          debug=None):      # DeepSpeed 0.19.8's exact signature: a script's patch may be written so
        return counted_rs(output_tensor, tensor, op, group, async_op, prof, debug)
    dist.reduce_scatter_fn = reduce_scatter_fn
    out = {}
    for stage in (2, 3):
        for coalesce in (False, True):
            counts.clear(), seen.clear()
            counts["on"] = False
            units, weights = _train(deepspeed.initialize, stage, rank, coalesce, counts)
            counts.pop("on")
            out[stage, coalesce] = dict(counts), list(seen), units, weights
    # a unit over RS_PIECE_BYTES per rank reduces in pieces: each a list-form reduce_scatter
    from zero_from_scratch.engine import comm as engine_comm
    engine_comm.RS_PIECE_BYTES = 64                  # 16 fp32 per piece: 100 elements per rank -> 7 pieces
    c = engine_comm.Comm()
    from zero_from_scratch.as_deepspeed import comm_names
    c.call_through(functools.partial(comm_names._call, dist))
    inp = torch.arange(200, dtype=torch.float32) * (rank + 1)
    block = torch.empty(100)
    counts.clear()
    counts["on"] = True
    c.reduce_scatter_single(block, inp)
    counts.pop("on")
    return own, out, (dict(counts), block)


def _reference():
    """SGD in one process: the mean over both ranks of the sum over micro-batches of each loss's gradient."""
    m = _model()
    grads = [torch.zeros_like(p) for p in m.parameters()]
    for rank in range(2):
        for k in range(ACC):
            m.zero_grad()
            x, y = _batch(k, rank)
            nn.functional.mse_loss(m(x), y).backward()
            for g, p in zip(grads, m.parameters()):
                g += p.grad / 2
    with torch.no_grad():
        return [p - LR * g for p, g in zip(m.parameters(), grads)]


def test_engine_collectives_go_through_served_names(spawn):
    ref = _reference()
    for rank, (own, out, (pieces, block)) in enumerate(spawn(_ranks, 2)):
        assert pieces == {"reduce_scatter": 7}, pieces
        assert torch.equal(block, torch.arange(100.0 * rank, 100.0 * (rank + 1)) * 3)    # rank 0's + rank 1's
        for (stage, coalesce), (counts, seen, units, weights) in out.items():
            backwards = 1 if coalesce else ACC
            rs = [n for name, n in seen if name == "reduce_scatter_fn"]
            assert len(units) > 1, units                  # several buckets: the count means something
            assert rs == units * backwards if stage == 2 else sorted(rs) == sorted(units * backwards), \
                (stage, coalesce, rs, units)
            if stage == 3:
                assert counts.get("allgather_fn", 0) >= len(units), counts   # parameter gathers
                assert "all_gather_into_tensor" not in counts, counts
            for a, b, r in zip(weights, own[stage, coalesce], ref):
                assert torch.equal(a, b), (stage, coalesce)            # the same calls as ringzero's own
                assert (a - r).abs().max() <= 1e-6, (stage, coalesce, (a - r).abs().max())
