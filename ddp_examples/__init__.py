"""Data parallelism from first principles, chapter by chapter (see tutorials/03_data_parallel.md).

    01_single_process.py   the reference: one process, the whole global batch
    02_naive.py            NaiveDataParallel: one all-reduce per parameter after backward
    03_flat.py             FlatDataParallel: one all-reduce over one flat gradient buffer
    04_bucketed.py         BucketedDataParallel: buckets all-reduced during backward
    05_torch_ddp.py        torch.nn.parallel.DistributedDataParallel, the reference implementation

The classes live in importable modules (naive.py, flat.py, bucketed.py); the numbered scripts
only wrap the shared model and loop of common.py.
"""
from ddp_examples.bucketed import BucketedDataParallel, plan_buckets
from ddp_examples.engine.common import Config, build_model, make_batch, reference, train
from ddp_examples.flat import FlatDataParallel
from ddp_examples.naive import NaiveDataParallel
from ddp_examples.engine.state import sync_initial_state

__all__ = ["NaiveDataParallel", "FlatDataParallel", "BucketedDataParallel", "plan_buckets",
           "sync_initial_state", "Config", "build_model", "make_batch", "train", "reference"]
