"""Helper for tests/test_launch.py: rank 1 dies before an all-reduce the others are waiting in.

    torchrun --standalone --nproc_per_node 2 tests/launch_dying_rank.py --timeout 10
"""
import argparse
import os

import torch

import primitives as P
from primitives.launch import add_launch_args, init_from_env

ap = argparse.ArgumentParser()
add_launch_args(ap)
args = ap.parse_args()
comm = init_from_env(args.backend, timeout=args.timeout)
if comm.rank == 1:
    os._exit(3)
P.all_reduce(torch.ones(1000), algorithm="ring")
print("rank 0 finished an all-reduce without rank 1 (wrong)", flush=True)
