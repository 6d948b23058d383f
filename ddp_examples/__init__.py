"""Data parallelism from first principles, chapter by chapter (see tutorials/03_data_parallel.md).

The textbook (read in this order): naive.py (one all-reduce per parameter), flat.py (one
all-reduce over one flat gradient buffer), bucketed.py (buckets all-reduced during backward);
each class takes the data-parallel `comm` and calls its collective methods.
The chapter scripts run them on one shared model and loop (engine/common.py):

    01_single_process.py   the reference: one process, the whole global batch
    02_naive.py            NaiveDataParallel
    03_flat.py             FlatDataParallel
    04_bucketed.py         BucketedDataParallel, overlapped with backward
    05_torch_ddp.py        torch.nn.parallel.DistributedDataParallel, the reference implementation

The package's NaiveDataParallel, FlatDataParallel and BucketedDataParallel are those classes as
a user calls them (engine/wrappers.py): a process group, the same start on every rank.
"""
import importlib

from ddp_examples.bucketed import plan_buckets

# the engine's names resolve on first use, so importing a textbook module loads no engine module
_ENGINE = {"NaiveDataParallel": "ddp_examples.engine.wrappers",
           "FlatDataParallel": "ddp_examples.engine.wrappers",
           "BucketedDataParallel": "ddp_examples.engine.wrappers",
           "sync_initial_state": "ddp_examples.engine.state",
           "Config": "ddp_examples.engine.common", "build_model": "ddp_examples.engine.common",
           "make_batch": "ddp_examples.engine.common", "train": "ddp_examples.engine.common",
           "reference": "ddp_examples.engine.common"}


def __getattr__(name):   # PEP 562: a lazy engine name
    if name in _ENGINE:
        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'ddp_examples' has no attribute {name!r}")


__all__ = ["NaiveDataParallel", "FlatDataParallel", "BucketedDataParallel", "plan_buckets",
           "sync_initial_state", "Config", "build_model", "make_batch", "train", "reference"]
