"""MultipleAllGatherHandles (engine/zero_partition.py), DeepSpeed's handle over several all-gathers.

    python -m pytest -q tests/test_ds_gather_handles.py

DeepSpeed 0.19.8 (runtime/zero/partition_parameters.py): wait() waits on every handle it holds and
hands handle_dependency on by keyword. One process, no torch.distributed (a world of one): the
handles of Init-held parameters' all_gather_coalesced, waited through it, leave every parameter
AVAILABLE with the plain constructor's values under the same seed; handles whose wait takes the
flag positionally, keyword-only or as **kwargs all receive it.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zero_from_scratch.engine.zero_init import Init
from zero_from_scratch.engine.zero_partition import MultipleAllGatherHandles, ZeroParamStatus


class Recorder:
    def __init__(self):
        self.seen = None

    def wait(self, *, handle_dependency=True):      # keyword-only: a positional hand-off would fail
        self.seen = handle_dependency


@pytest.mark.skipif(dist.is_initialized(), reason="needs a process without torch.distributed")
def test_waits_every_handle_and_passes_handle_dependency_by_keyword():
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    torch.manual_seed(0)
    with Init(dtype=torch.float32):
        m = nn.Linear(4, 3)
    params = list(m.parameters())
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params)
    rec = Recorder()
    MultipleAllGatherHandles([p.all_gather_coalesced([p]) for p in params] + [rec]).wait(handle_dependency=False)
    assert rec.seen is False
    assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in params)
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)
