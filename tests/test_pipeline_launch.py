"""The demo under the real launchers (slow: each pays interpreter + torch + data start-up per rank):
torchrun with pp = 2 × dp = 2, and DeepSpeed's launcher running DeepSpeed's engine and ours on the
same layers — they print the same losses. Free ports: torchrun and deepspeed both default to 29500."""
import re

import pytest

from conftest import run_cmd
from primitives.launch import free_port

SMALL = "--steps 2 --dim 32 --layers 2 --heads 2 --micro-batch-size 2 --seq 16 --texts 200"


def _losses(out):
    return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", out)]


@pytest.mark.slow
def test_torchrun_pp2_dp2():
    r = run_cmd(f"torchrun --nproc_per_node 4 --master_port {free_port()} pipeline_parallel/train.py "
                f"--pp 2 --dp 2 --schedule 1f1b {SMALL}", timeout=600)
    assert "pp=2 × dp=2" in r.stdout and len(_losses(r.stdout)) == 2 and "measured bubble" in r.stdout


@pytest.mark.slow
def test_deepspeed_launcher_both_engines_agree():
    pytest.importorskip("deepspeed")
    ds = run_cmd(f"deepspeed --num_gpus 2 --master_port {free_port()} pipeline_parallel/train.py --pp 2 "
                 f"--engine deepspeed {SMALL}", timeout=900, env={"OMP_NUM_THREADS": "1"})
    ours = run_cmd(f"deepspeed --num_gpus 2 --master_port {free_port()} pipeline_parallel/train.py --pp 2 {SMALL}",
                   timeout=900, env={"OMP_NUM_THREADS": "1"})
    a, b = _losses(ds.stdout), _losses(ours.stdout)
    assert len(a) == len(b) == 2 and max(abs(x - y) for x, y in zip(a, b)) <= 1.5e-4, (a, b)   # printed to 4 decimals
