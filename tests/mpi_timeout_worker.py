"""Under mpiexec -n 2 (tests/test_mpi.py): a receive that times out is cancelled, so a message
that arrives late can never write into the tensor the caller has reused since.

    mpiexec -n 2 python tests/mpi_timeout_worker.py
"""
import time

import torch

import primitives as P
from primitives.launch import init_from_env

comm = init_from_env("mpi", timeout=2)
buf = torch.zeros(4)
if comm.rank == 0:
    try:
        comm.recv(buf, 1)                       # rank 1 sends only after this rank gave up
        raise SystemExit("rank 0: the receive did not time out")
    except P.PeerError as e:
        assert "cancelled" in str(e), e
    buf.fill_(-1.0)                             # the caller reuses its tensor
    comm.mpi.Barrier()
    time.sleep(0.5)                             # the late message has had time to land
    assert buf.tolist() == [-1.0] * 4, f"a late message wrote into a reused tensor: {buf.tolist()}"
    print("MPI TIMEOUT CANCEL OK")
else:
    time.sleep(3)
    comm.mpi.Isend([torch.full((4,), 9.0).numpy(), comm.MPI.FLOAT], dest=0, tag=7)
    comm.mpi.Barrier()
    time.sleep(0.5)
