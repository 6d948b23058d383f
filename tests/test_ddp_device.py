"""Device-correct data parallelism: every buffer on the parameters' device, mixed devices refused.

CPU-only machines check the refusals (a 'meta' tensor stands in for a second device); the CUDA
test runs wherever a GPU is visible (nccl, world of one) and skips elsewhere.
"""
import pytest
import torch
import torch.nn as nn

from ddp_examples.engine.wrappers import BucketedDataParallel, FlatDataParallel, NaiveDataParallel

WRAPPERS = {"naive": NaiveDataParallel, "flat": FlatDataParallel, "bucketed": BucketedDataParallel}


def _refusals(rank, n):
    out = {}
    for name, cls in WRAPPERS.items():
        mixed = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        mixed[1].to("meta")                                    # half the model on another device
        on_meta = nn.Linear(3, 2).to("meta")                   # all of it where gloo cannot go
        for label, model in (("mixed", mixed), ("meta", on_meta)):
            try:
                cls(model)
                out[(name, label)] = "accepted"
            except ValueError as e:
                out[(name, label)] = str(e)
    return out


def test_mixed_devices_and_wrong_device_are_refused(spawn):
    out = spawn(_refusals, 2)
    for rank, res in enumerate(out):
        for (name, label), msg in res.items():
            assert msg.startswith(f"rank {rank}: "), (name, label, msg)
            if label == "mixed":
                assert "2 devices" in msg and "cpu" in msg and "meta" in msg and "'1.weight'" in msg, msg
            else:
                assert "is on meta" in msg and "backend gloo" in msg and "cpu" in msg, msg


def _cuda_chapters(rank, n):
    import importlib
    from ddp_examples.engine.common import Config, build_model, train
    cfg = Config(steps=3, bucket_cap_mb=0.004)
    out = {}
    for ch in ("02_naive", "03_flat", "04_bucketed"):
        model = importlib.import_module(f"ddp_examples.{ch}").wrap(build_model(cfg).cuda(), cfg)
        inner = model.module
        res = train(model, cfg, rank, n)     # gradients exist once a backward has run
        devices = {str(p.device) for p in inner.parameters()} | {str(p.grad.device) for p in inner.parameters()}
        out[ch] = (devices, res.params)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chapters_on_cuda_match_single_process(spawn):
    from ddp_examples.engine.common import Config, max_diff, reference
    ref = reference(Config(steps=3, bucket_cap_mb=0.004)).params
    res = spawn(_cuda_chapters, 1, backend="nccl")[0]
    for ch, (devices, params) in res.items():
        assert all(d.startswith("cuda") for d in devices), (ch, devices)
        assert max_diff(params, ref) < 1e-5, ch
