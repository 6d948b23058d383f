"""Helper for tests/test_launch.py and tests/test_faults.py: a rank dies while the others wait for it.

    torchrun --standalone --nproc_per_node 2 tests/launch_dying_rank.py --timeout 10
    RANK=r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/launch_dying_rank.py --before-shm

Default: rank 1 dies before an all-reduce the others are waiting in. --before-shm (env:// start, so
rank 0 hosts the store): the last rank dies after the process group exists and before the
shared-memory rendezvous; rank 1 starts that rendezvous a second late, after rank 0 gave up.
Each survivor prints its error on one line.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import primitives as P
from primitives.engine import faults
from primitives.launch import add_launch_args, init_from_env

ap = argparse.ArgumentParser()
add_launch_args(ap)
ap.add_argument("--before-shm", action="store_true", help="die before the shared-memory rendezvous")
args = ap.parse_args()
if args.before_shm:
    dist.init_process_group("gloo")
    faults.hello()
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == n - 1:
        os._exit(3)
    if rank == 1:
        time.sleep(1.0)
    t0 = time.monotonic()
    try:
        P.get_comm()
        print(f"rank {rank}: built a communicator without rank {n - 1} (wrong)", flush=True)
    except Exception as e:
        print(f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {' '.join(str(e).split())}", flush=True)
    os._exit(0)
comm = init_from_env(args.backend, timeout=args.timeout)
if comm.rank == 1:
    os._exit(3)
P.all_reduce(torch.ones(1000), algorithm="ring")
print("rank 0 finished an all-reduce without rank 1 (wrong)", flush=True)
