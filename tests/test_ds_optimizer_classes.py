"""DeepSpeed's ZeRO-1/2 optimizer classes under the runner (as_deepspeed/optimizer_classes.py).

    python -m pytest -q tests/test_ds_optimizer_classes.py

2 ranks (gloo), `import deepspeed` served by ringzero. bf16 + grad_accum_dtype fp32 at stage 1 (DeepSpeed's
BF16_Optimizer), ACC micro-batches, one step. Checked against one process that computes each rank's
micro-batch gradients with the same bf16 model: between boundaries fp32_groups_gradients_flat holds this
rank's fp32 sum of its bf16 gradients (exact: the same adds); after the boundary every rank holds the whole
average, reduced as DeepSpeed's (its fp32 sums cast to bf16, summed in bf16, averaged in fp32: at 2 ranks one
bf16 add, so the reference does exactly that and the match is exact; tolerance 0). ringzero's own entry point
reduce-scatters instead (the other rank's block stays unreduced there: the runner's all-reduce is real), and
both update the weights bit for bit alike. isinstance: BF16_Optimizer there and with nvme optimizer offload,
DeepSpeedZeroOptimizer at stage 2 and with CPU offload (DeepSpeed's zero_cpu_offload()); the nvme one
trains (Adam, one step) bit for bit as without offload; compute_grad_norm
false in BF16_Optimizer's configuration: DeepSpeed's ValueError.
"""
import tempfile

import torch
import torch.nn as nn

MB, ACC = 2, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).bfloat16()


def _batch(micro, rank):
    g = torch.Generator().manual_seed(10 * micro + rank)
    return torch.randn(MB, 4, generator=g).bfloat16(), torch.randn(MB, 2, generator=g)


def _loss(m, x, y):
    return nn.functional.mse_loss(m(x).float(), y)


def _config(stage, opt="SGD", **zero):
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": ACC, "gradient_clipping": 0.0,
            "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {"stage": stage, **zero}, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": opt, "params": {"lr": 0.1}}}


def _train(init, rank, grads=None):
    m = _model()
    engine, *_ = init(model=m, model_parameters=m.parameters(), config=_config(1))
    for k in range(ACC):
        engine.backward(_loss(engine, *_batch(k, rank)))
        if grads is not None:
            grads.append(engine.optimizer.fp32_groups_gradients_flat[0].clone())
        if k == ACC - 1:
            full = engine.stage.gflat[0].clone()      # the stage's fp32 buffer after the boundary reduction
        engine.step()
    return full, [p.detach().clone() for p in m.parameters()]


def _ranks(rank, world):
    import zero_from_scratch
    own = _train(zero_from_scratch.initialize, rank)
    from zero_from_scratch.as_deepspeed import finder
    finder.install()
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    grads = []
    served = _train(deepspeed.initialize, rank, grads)
    m = _model()
    e2, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(2))
    m = _model()
    e1, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(1))
    engines = {"stage1": e1, "stage2": e2}
    for name, dev in (("cpu", "cpu"), ("nvme", "nvme")):
        m = _model()
        engines[name], *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(
            1, "Adam", offload_optimizer={"device": dev, "nvme_path": tempfile.mkdtemp()}))
    kinds = {k: (isinstance(e.optimizer, BF16_Optimizer), isinstance(e.optimizer, DeepSpeedZeroOptimizer))
             for k, e in engines.items()}
    m = _model()
    adam, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(1, "Adam"))
    for e in (engines["nvme"], adam):                     # nvme under BF16_Optimizer trains as without offload
        for k in range(ACC):
            e.backward(_loss(e, *_batch(k, rank)))
            e.step()
    kinds["nvme_equal"] = all(torch.equal(a, b) for a, b in zip(engines["nvme"].module.parameters(), m.parameters())) \
        and not torch.equal(next(m.parameters()), next(_model().parameters()))       # and it did step
    m = _model()
    try:
        deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(1, compute_grad_norm=False))
        kinds["no_norm"] = "built"
    except ValueError as e:
        kinds["no_norm"] = str(e)
    return own, served, grads, kinds


def _flat_grads(rank):
    """Per micro-batch, this rank's bf16 gradients flattened in parameter order, as fp32."""
    m = _model()
    out = []
    for k in range(ACC):
        m.zero_grad()
        (_loss(m, *_batch(k, rank)) / ACC).backward()
        out.append(torch.cat([p.grad.reshape(-1).float() for p in m.parameters()]))
    return out


def test_bf16_optimizer_gradients_as_deepspeed(spawn):
    per_rank = [_flat_grads(r) for r in range(2)]
    sums = [g[0] + g[1] for g in per_rank]                          # fp32 adds of bf16 gradients (ACC = 2)
    mean = (sums[0].bfloat16() + sums[1].bfloat16()).float() / 2    # the bf16 all-reduce, averaged in fp32
    n = mean.numel()
    results = spawn(_ranks, 2)
    for rank, (own, served, grads, kinds) in enumerate(results):
        assert kinds == {"stage1": (True, False), "stage2": (False, True), "cpu": (False, True), "nvme": (True, False), "nvme_equal": True,
                         "no_norm": "zero_optimization.compute_grad_norm=false does not support ZeRO Stage 1 with "
                                    "BF16 parameters and FP32 gradient accumulation"}, kinds
        assert torch.equal(grads[0][:n], per_rank[rank][0])         # between boundaries: this rank's sum
        assert torch.equal(grads[1][:n], mean), (grads[1][:n] - mean).abs().max()
        assert not torch.equal(own[0][:n], served[0][:n])           # ringzero's own: the other block unreduced
        for a, b in zip(own[1], served[1]):
            assert torch.equal(a, b)                                # the same update either way
    assert torch.equal(results[0][2][1], results[1][2][1])          # every rank the whole average
