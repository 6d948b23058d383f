"""engine.optimizer.accumulated_grads_in_cpu under the runner (zero_from_scratch/as_deepspeed/accumulated_grads.py).

    python -m pytest -q tests/test_ds_accumulated_grads.py

2 ranks, ZeRO-1 and ZeRO-2 with offload_optimizer cpu, 3 micro-batches per step. After every
backward, the ranks' views are summed (each element is in exactly one rank's part) and compared with
an independent reference: one process, a copy of the model, each rank's micro-batch gradient of
loss/3, averaged over the ranks, summed over the micro-batches so far. fp32; tolerance 1e-6 relative
(the same sums in another order). Which backwards fill the buffers is DeepSpeed's rule: ZeRO-2 from
the first backward, ZeRO-1 at the boundary, a step of one backward never, and with bf16 and
data_types.grad_accum_dtype fp32 never at all (DeepSpeed's compact fp32 partition: the dict stays empty).
"""
import copy

import torch
import torch.distributed as dist
from torch import nn

from zero_from_scratch.as_deepspeed import finder

GA, WORLD = 3, 2


def _batch(rank, i):
    g = torch.Generator().manual_seed(10 * i + rank)
    return torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)


def _loss(model, rank, i):
    x, y = _batch(rank, i)
    return ((model(x) - y) ** 2).mean()


def _engine(deepspeed, model, stage, ga, **more):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, **more,
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
           "zero_force_ds_cpu_optimizer": False,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _run(rank, world):
    finder.install()
    import deepspeed
    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        start = copy.deepcopy(model)
        engine = _engine(deepspeed, model, stage, GA)
        sizes = [p.numel() for p in start.parameters()]
        seen = []
        for i in range(GA):
            engine.backward(_loss(engine, rank, i))
            view = engine.optimizer.accumulated_grads_in_cpu
            vec = torch.zeros(sum(sizes))
            for pid, v in view.items():
                off = sum(sizes[:pid])
                vec[off:off + sizes[pid]] += v.float()
            dist.all_reduce(vec)
            seen.append((len(view), vec))
            engine.step()                                  # DeepSpeed's loop: a step per micro-batch
        one = _engine(deepspeed, copy.deepcopy(start), stage, 1)     # a step of one backward
        one.backward(_loss(one, rank, 0))
        one.step()
        compact = _engine(deepspeed, copy.deepcopy(start).bfloat16(), stage, 2, bf16={"enabled": True},
                          data_types={"grad_accum_dtype": "fp32"})
        lens = []
        for i in range(2):
            x, y = _batch(rank, i)
            compact.backward(((compact(x.bfloat16()) - y.bfloat16()) ** 2).mean())
            lens.append(dict(compact.optimizer.accumulated_grads_in_cpu))
            compact.step()
        out[stage] = (seen, len(one.optimizer.accumulated_grads_in_cpu), start, lens)
    return out


def _reference(start):
    sums, acc = [], None
    for i in range(GA):
        grads = []
        for r in range(WORLD):
            m = copy.deepcopy(start)
            (_loss(m, r, i) / GA).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
        g = torch.stack(grads).mean(0)
        acc = g if acc is None else acc + g
        sums.append(acc.clone())
    return sums


def test_accumulated_grads_in_cpu_hold_the_reduced_sum_as_deepspeeds_do(spawn):
    outs = spawn(_run, WORLD)
    for stage in (1, 2):
        seen, single, start, compact = outs[0][stage]
        ref = _reference(start)
        assert single == 0                                 # one backward per step: nothing allocated
        assert all(o[stage][3] == [{}, {}] for o in outs)  # bf16 + fp32 accumulation: never filled
        assert all(o[stage][0][-1][0] > 0 for o in outs)     # every rank holds a part of some parameter
        for i, (n, vec) in enumerate(seen):
            filled = stage == 2 or i == GA - 1
            if not filled:
                assert n == 0 and not vec.any(), (stage, i)
                continue
            assert torch.allclose(vec, ref[i], rtol=1e-6, atol=1e-8), (stage, i, (vec - ref[i]).abs().max())
        for o in outs[1:]:
            assert all(torch.equal(a[1], b[1]) for a, b in zip(o[stage][0], seen))
