"""The same collectives over MPI (mpi4py + MPICH), launched by mpiexec from pytest.

tests/mpi_worker.py does the checks on every rank and exits non-zero on any mismatch;
here we only launch it with a timeout and surface its report."""
import pytest

from conftest import have_mpi, run_cmd

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpiexec (pip install -e .[mpi])")]

# MPICH busy-polls; with more ranks than cores (2 here) heavy yield keeps small collectives in
# milliseconds instead of seconds. A short comm timeout turns any stuck wait into an error.
ENV = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OMP_NUM_THREADS": "1", "RINGZERO_TIMEOUT": "30"}


@pytest.mark.parametrize("n", [3, pytest.param(4, marks=pytest.mark.slow)])   # the algorithms at 4: gloo's sweep
def test_every_collective_under_mpi(n):
    r = run_cmd(f"mpiexec -n {n} python tests/mpi_worker.py", env=ENV, timeout=240, check=False)
    assert r.returncode == 0 and f"MPI CHECK OK on {n} ranks" in r.stdout, \
        f"rc={r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-3000:]}"


def test_bad_input_under_mpi():
    r = run_cmd("mpiexec -n 3 python tests/mpi_worker.py --bad", env=ENV, timeout=120, check=False)
    assert r.returncode == 0 and "MPI CHECK OK on 3 ranks (bad input)" in r.stdout, \
        f"rc={r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-3000:]}"


def test_mpiexec_without_backend_flag_explains():
    """Started by mpiexec but asked for gloo: a clear exit telling the user to pass --backend mpi."""
    r = run_cmd("mpiexec -n 2 python -c \"from primitives.launch import init_from_env; init_from_env('gloo')\"",
                env=ENV, timeout=120, check=False)
    assert r.returncode != 0
    assert "--backend mpi" in r.stdout + r.stderr


def test_timeout_cancels_posted_receive():
    """A late message must not land in a tensor reused after a timeout (MPIComm.cancel_posted)."""
    r = run_cmd("mpiexec -n 2 python tests/mpi_timeout_worker.py", env=ENV, timeout=120, check=False)
    assert r.returncode == 0 and "MPI TIMEOUT CANCEL OK" in r.stdout, \
        f"rc={r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
