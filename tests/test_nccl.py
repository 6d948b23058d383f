"""nccl: every collective × algorithm on CUDA tensors, compared with nccl's built-ins.

Runs at world size 1 (the only size one GPU allows: nccl refuses two ranks on one device), and
at torch.cuda.device_count() ranks when there are more GPUs. World size 1 still exercises the
CUDA code paths (device checks, scratch buffers, copies back into non-contiguous views) and the
reference; the multi-rank nccl path is untested on the development machine (no GPU).
"""
import pytest
import torch

import primitives as P

import collective_checks as C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on a GPU machine")


def _nccl_work(rank, n):
    comm = P.get_comm()
    assert comm.backend == "nccl" and comm.device.type == "cuda"
    errs, cases = C.matrix(comm, [0, 1, 2 * n + 1, 10007])
    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32)):
        e, c = C.matrix(comm, [37], dtype=dtype, ops=("sum", "max", "avg"), seed=10 * i)
        errs += e
    e, c = C.matrix(comm, [15], layouts=("strided", "transposed"), seed=99)
    errs += e
    # a CPU tensor on an nccl communicator is a clear error, not a crash inside nccl
    try:
        P.all_reduce(torch.ones(3))
        errs.append("CPU tensor accepted by the nccl communicator")
    except P.CollectiveError as ex:
        if "cuda" not in str(ex) or "'tensor'" not in str(ex):
            errs.append(f"unclear error for a CPU tensor: {ex}")
    return errs


@pytest.mark.parametrize("n", sorted({1, torch.cuda.device_count() if torch.cuda.is_available() else 1}))
def test_every_collective_on_nccl(spawn, n):
    results = spawn(_nccl_work, n, backend="nccl")
    errs = [e for r in results for e in r]
    assert not errs, "\n".join(errs[:20])
