"""The chapter scripts under their real launchers, exactly as their docstrings say.

Each run prints a rich table on rank 0; we read it back and check the numbers the chapter
claims: parameters equal to the single-process run (TOL as in test_ddp.py), ranks identical,
ledger bytes equal to 2(N−1)/N·Ψ·4.
"""
import re

import pytest

from conftest import have_mpi, run_cmd

TOL = 1e-5   # see test_ddp.py: float32 summation-order drift over ≤ 12 SGD steps is ≲ 2e-5 worst case, ~1e-8 measured


def _row(out: str, label: str) -> str:
    m = re.search(r"│ " + re.escape(label) + r"\s*│\s*([^│]+?)\s*│", out)
    assert m, f"row {label!r} missing from the table:\n{out}"
    return m.group(1)


def _check_table(out: str, world: int, accum: int):
    assert _row(out, "ranks × micro-batches") == f"{world} × {accum}"
    assert float(_row(out, "max |param − single-process param|")) <= TOL
    assert float(_row(out, "max |param − rank 0 param|")) == 0.0
    psi = int(_row(out, "parameters Ψ").replace(",", ""))
    sent = int(_row(out, "bytes sent per step, this rank (ledger)").replace(",", ""))
    assert sent == 2 * (world - 1) * psi * 4 // world == int(_row(out, "2(N−1)/N·Ψ·4 bytes").replace(",", ""))


def test_torchrun_bucketed_with_accumulation():
    r = run_cmd("torchrun --standalone --nproc_per_node 2 ddp_examples/04_bucketed.py "
                "--steps 10 --accum 2 --bucket-cap-mb 0.004", timeout=240)
    _check_table(r.stdout, 2, 2)
    assert _row(r.stdout, "collective calls per step") == "4"     # 4 buckets, once per optimizer step


@pytest.mark.mpi
@pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpiexec (pip install -e .[mpi])")
def test_mpiexec_flat():
    r = run_cmd("mpiexec -n 2 python ddp_examples/03_flat.py --backend mpi --steps 10", timeout=240,
                env={"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"})   # MPICH busy-polls; ranks share 2 cores
    _check_table(r.stdout, 2, 1)
    assert _row(r.stdout, "backend") == "mpi"
