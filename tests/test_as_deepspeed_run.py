"""The `deepspeed` runner running scripts: an unchanged script on 2 ranks, the clients' patches, zero_to_fp32.

    python -m pytest -x -q tests/test_as_deepspeed_run.py

The run under torchrun is compared with the same training written against zero_from_scratch.initialize
directly (an independent process group from spawn): the runner must add nothing to the numbers, so the
losses are equal bit for bit. clients/README.md has the comparisons with the real DeepSpeed.
"""
import os
import random

import numpy
import pytest
import torch
import torch.distributed as dist

from primitives.launch import free_port
from tests.conftest import run_cmd
from zero_from_scratch.as_deepspeed import finder

HERE = os.path.dirname(os.path.abspath(finder.__file__))

TINY = '''
import argparse
import sys

import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=4)
p = deepspeed.add_config_arguments(p)
args = p.parse_args()
deepspeed.init_distributed()
deepspeed.runtime.utils.set_random_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
engine, opt, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
dev = get_accelerator().device_name(dist.get_local_rank())
for step in range(args.steps):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    loss = ((engine(x.to(dev)) - y.to(dev)) ** 2).mean()
    engine.backward(loss)
    engine.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        print("LOSS", step, repr(t.item()))
ours = lambda m: type(m).__name__ == "ServedModule"
if dist.get_rank() == 0:
    print("FILE", deepspeed.__file__, "VERSION", deepspeed.__version__, "ARGV", sys.argv[1:3])
    print("REAL", sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "deepspeed" and not ours(m)))
'''
CONFIG = ('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, '
          '"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": true}}}')


def _reference_and_comm(rank, world):
    """The TINY script's training written against zero_from_scratch.initialize, and deepspeed.comm vs torch."""
    finder.install()
    import deepspeed.comm as ds_dist
    x = torch.arange(6, dtype=torch.float32) + rank
    y = x.clone()
    ds_dist.all_reduce(x)
    dist.all_reduce(y)
    out, want = torch.empty(12), torch.empty(12)
    ds_dist.all_gather_into_tensor(out, x)
    dist.all_gather_into_tensor(want, x)
    rs, rs_want = torch.empty(3), torch.empty(3)
    ds_dist.reduce_scatter_tensor(rs, x * (rank + 1))
    dist.reduce_scatter_tensor(rs_want, x * (rank + 1))
    b = torch.full((2,), float(rank))
    ds_dist.broadcast(b, 1)
    ds_dist.barrier()
    comm = (torch.equal(x, y), torch.equal(out, want), torch.equal(rs, rs_want), b.tolist(),
            ds_dist.get_rank(), ds_dist.get_world_size(), ds_dist.is_initialized())
    import deepspeed
    try:
        deepspeed.initialize(model=torch.nn.Linear(1, 1), config={}, mesh_param=(2, 1))
    except finder.NotServedError as e:
        comm += (str(e),)
    finder.uninstall()
    import json
    import zero_from_scratch
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(),
                                              config=json.loads(CONFIG))
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        xb, yb = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = ((engine(xb) - yb) ** 2).mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
    return comm, losses


def test_unchanged_script_under_torchrun_equals_zero_from_scratch_directly(tmp_path, spawn):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "ds.json").write_text(CONFIG)
    r = run_cmd(f"torchrun --nproc_per_node 2 --master_port {free_port()} -m zero_from_scratch.as_deepspeed "
                f"{tmp_path}/tiny.py --deepspeed_config {tmp_path}/ds.json", timeout=240)
    assert "ringzero serves deepspeed (DeepSpeed 0.19.8's API)" in " ".join(r.stderr.split())
    lines = [ln.split() for ln in r.stdout.splitlines()]
    losses = [float(ln[2]) for ln in lines if ln[:1] == ["LOSS"]]
    file_line = next(ln for ln in lines if ln[:1] == ["FILE"])
    assert file_line[1] == os.path.join(HERE, "top.py") and file_line[3] == "0.19.8"
    assert next(ln for ln in r.stdout.splitlines() if ln.startswith("REAL")) == "REAL []"   # DeepSpeed never imported
    (comm0, ref), (comm1, _) = spawn(_reference_and_comm, 2)
    assert comm0[:7] == (True, True, True, [1.0, 1.0], 0, 2, True) and comm1[4] == 1
    assert comm0[7].startswith("deepspeed.initialize(mesh_param=...) is not served by ringzero")
    assert len(losses) == 4 and losses == ref


@pytest.mark.parametrize("patched, diff", [("clients/cifar10/cifar10_deepspeed.py", "clients/cifar10/cifar10.diff"),
                                           ("clients/hello_deepspeed/train_bert_ds.py",
                                            "clients/hello_deepspeed/train_bert_ds.diff")])
def test_client_diffs_are_the_whole_change_from_upstream(patched, diff):
    """The .diff kept beside each client lists every line changed from upstream.py (the file at
    DeepSpeedExamples' commit named in clients/README.md): the readable record of the patch."""
    import difflib

    from tests import upstream
    up_path = os.path.join(os.path.dirname(patched), "upstream.py")
    if not (upstream.present(patched) and upstream.present(up_path)):
        pytest.skip(upstream.skip_reason(up_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    read = lambda p: open(os.path.join(root, p), newline="").read().splitlines()   # noqa: E731
    up = read(os.path.join(os.path.dirname(patched), "upstream.py"))
    changed = [ln for ln in difflib.unified_diff(up, read(patched), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    kept = [ln for ln in read(diff) if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert sorted(changed) == sorted(kept) and changed   # the same lines (diff tools align blank lines differently)


def _zero_to_fp32(rank, world, ckpt):
    """A ZeRO-2 checkpoint of 2 ranks read back through deepspeed.utils.zero_to_fp32's three functions."""
    import zero_from_scratch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(),
                                              config={"train_micro_batch_size_per_gpu": 2, "zero_optimization":
                                                      {"stage": 2}, "optimizer": {"type": "AdamW",
                                                                                  "params": {"lr": 0.1}}})
    for step in range(2):
        engine.backward(engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(step + 10 * rank))).sum())
        engine.step()
    engine.save_checkpoint(ckpt)
    dist.barrier()
    if rank != 0:
        return None
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}   # stage 2: full parameters here
    finder.install()
    try:
        from deepspeed.utils import zero_to_fp32 as z
        sd = z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, f"{ckpt}/out", max_shard_size=300)
        shards = sorted(f for f in os.listdir(f"{ckpt}/out") if f.endswith(".bin"))
        merged = {k: v for f in shards for k, v in torch.load(f"{ckpt}/out/{f}").items()}
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        loaded = z.load_state_dict_from_zero_checkpoint(fresh, ckpt).state_dict()
        lazy = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)   # ordinary tensors, same values
        index = os.path.isfile(f"{ckpt}/out/pytorch_model.bin.index.json")
    finally:
        finder.uninstall()
    same = lambda a: sorted(a) == sorted(want) and all(torch.equal(a[k], want[k]) for k in want)   # noqa: E731
    return same(sd), same(merged), same(loaded), len(shards), index, same(lazy)


def test_zero_to_fp32_functions_read_a_zero2_checkpoint(tmp_path, spawn):
    got = spawn(_zero_to_fp32, 2, args=(str(tmp_path / "ck"),))[0]
    assert got[:3] == (True, True, True) and got[3] > 1 and got[4] and got[5]   # sharded at 300 B, with its index
