"""Bodies of our own for DeepSpeed's quirks the runner follows (zero_from_scratch/as_deepspeed/quirks.py),
run like the ported ones: the same code under the installed DeepSpeed and under ringzero (harness.py).

    python -m tests.ds_unit.harness test_deprecated_cpu_offload test_model_parameters_subset

What each records (harness.RECORD via record(), compared within harness.TOLERANCE) besides the losses: facts as
1.0/0.0 and the values a script reads. Not DeepSpeed's code: written here, in its tests' style, on a model of
the shape DeepSpeed's tests use (Linear layers, then cross-entropy against a random class).
Cost: a few optimizer steps of a small model each.
"""
import contextlib
import io
import sys

import torch

import deepspeed


def record(kind: str, value) -> None:
    """Append to the recorder of the harness running this body (imported as a module, or run as __main__)."""
    lists = {id(m.RECORD): m.RECORD for m in map(sys.modules.get, ("tests.ds_unit.harness", "__main__", "__mp_main__"))
             if m is not None and hasattr(m, "RECORD")}
    for lst in lists.values():
        lst.append((kind, value))
HIDDEN = 10
F32 = torch.float32


class SimpleModel(torch.nn.Module):
    """`nlayers` Linear(h, h) in a chain, then cross-entropy against the label."""

    def __init__(self, hidden: int, nlayers: int = 1):
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(nlayers))

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def random_dataloader(engine, samples: int, hidden: int, device, dtype=F32):
    """`samples` random rows and labels in micro-batches of the engine's size (seeded by the harness)."""
    x, y = torch.randn(samples, hidden, dtype=dtype), torch.randint(0, hidden, (samples,))
    b = engine.train_micro_batch_size_per_gpu()
    return [(x[i:i + b].to(device), y[i:i + b].to(device)) for i in range(0, samples, b)]


def _config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, **zero}}


def _train(engine, steps: int = 3) -> None:
    for n, (x, y) in enumerate(random_dataloader(engine, 2 * steps, HIDDEN, engine.device, dtype=F32)):
        engine.backward(engine(x, y))
        engine.step()


def test_deprecated_cpu_offload(zero_stage):
    """zero_optimization.cpu_offload: true is offload_optimizer cpu (DeepSpeed 0.19.8 warns and maps it)."""
    model = SimpleModel(HIDDEN)
    cfg = {**_config(zero_stage, cpu_offload=True), "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _train(engine)


def test_model_parameters_subset(zero_stage, subset=True):
    """model_parameters holding one Linear of two: that one trains, the other keeps its initial values."""
    model = SimpleModel(HIDDEN, nlayers=2)
    before = [p.detach().clone() for p in model.linears[1].parameters()]
    given = model.linears[0] if subset else model
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(given.parameters()),
                                      config=_config(zero_stage))
    _train(engine)
    zero3 = [p for p in model.parameters() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(zero3, enabled=bool(zero3)):
        after = [p.detach().clone() for p in model.linears[1].parameters()]
        trained = [p.detach().float().sum().item() for p in model.linears[0].parameters()]
    record("left out unchanged", float(all(torch.equal(a, b) for a, b in zip(before, after))))
    record("trained sums", trained)


def test_torch_optimizer_inside(zero_stage):
    """engine.optimizer.optimizer: the torch optimizer DeepSpeed's ZeRO wrapper holds (its lr, its class's
    methods); no further .optimizer below it."""
    model = SimpleModel(HIDDEN)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(zero_stage))
    _train(engine, 1)
    inner = engine.optimizer.optimizer
    record("lr", [g["lr"] for g in inner.param_groups][:1])
    record("no deeper optimizer", float(not hasattr(inner, "optimizer")))
    record("has state_dict", float("param_groups" in inner.state_dict()))


def test_see_memory_usage_and_zero_utils():
    """see_memory_usage prints only with force=True, three lines, on rank 0; ZeRORuntimeException is served."""
    from deepspeed.runtime.utils import see_memory_usage
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        see_memory_usage("not forced")
        see_memory_usage("before the model", force=True)
    lines = out.getvalue().splitlines()
    record("lines", float(len(lines)))
    record("message first", float(bool(lines) and lines[0] == "before the model"))
    record("MA and CPU lines", float(len(lines) == 3 and lines[1].startswith("MA ")
                                             and lines[2].startswith("CPU Virtual Memory:")))
    record("ZeRORuntimeException", float(issubclass(deepspeed.runtime.zero.utils.ZeRORuntimeException,
                                                            Exception)))


def test_zero3_attributes():
    """After initialize at stage 3, every parameter has ds_id, ds_shape, ds_numel, ds_status, and a ds_tensor
    shaped as this rank's partition (ceil(numel / N) elements, its own ds_numel)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    model = SimpleModel(HIDDEN)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(3))
    for n, p in model.named_parameters():
        record(n, [float(hasattr(p, "ds_id")), float(p.ds_numel), float(torch.Size(p.ds_shape).numel()),
                           float(p.ds_tensor.numel()), float(p.ds_tensor.ds_numel),
                           float(p.ds_status == ZeroParamStatus.NOT_AVAILABLE), float(p.ds_tensor.dtype == p.dtype)])
    _train(engine, 1)
