"""DeepSpeedExamples clients, unchanged but for offline data and sizes, on 2 ranks: real DeepSpeed vs the runner.

    python -m pytest -q -m slow tests/test_as_deepspeed_clients.py      (~8 min on 2 cores)
    python -m clients.compare                                           (the same comparisons as a table)

Each case runs the client under the installed DeepSpeed 0.19.8 and under
`zero_from_scratch.as_deepspeed` (clients/run.py: same start-up seed on both sides) and compares
the per-step losses the script itself reports: fp32 within 1e-5 relative, bf16 within one bf16
ulp of the loss (clients/compare.py::tolerance). The runner must also work under the deepspeed
launcher, which passes --local_rank=N before the script.
"""
import pytest

from clients.cases import CASES
from clients.compare import compare
from primitives.launch import free_port
from tests import upstream
from tests.conftest import run_cmd
from tests.test_as_deepspeed_run import CONFIG, TINY


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("name", list(CASES))
def test_client_losses_equal_real_deepspeeds(name):
    if not upstream.present(CASES[name].script):
        pytest.skip(upstream.skip_reason(CASES[name].script))
    c = compare(name)
    assert c["same_steps"] and c["steps"] >= 6, c
    assert c["within"], (f"{name}: step {c['worst_step'] + 1}: deepspeed {c['deepspeed']} vs ringzero "
                         f"{c['ringzero']} (max rel {c['max_rel']:.2e})")


@pytest.mark.slow
@pytest.mark.deepspeed
def test_runner_under_the_deepspeed_launcher_equals_torchrun(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "ds.json").write_text(CONFIG)
    args = f"{tmp_path}/tiny.py --deepspeed_config {tmp_path}/ds.json"
    ds = run_cmd(f"deepspeed --num_gpus 2 --master_port {free_port()} --module zero_from_scratch.as_deepspeed {args}",
                 timeout=400, env={"OMP_NUM_THREADS": "1"})
    tr = run_cmd(f"torchrun --nproc_per_node 2 --master_port {free_port()} -m zero_from_scratch.as_deepspeed {args}",
                 timeout=400)
    losses = [[ln for ln in r.stdout.splitlines() if ln.startswith("LOSS")] for r in (ds, tr)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert "ARGV ['--local_rank=0', '--deepspeed_config']" in ds.stdout   # the launcher's flag, handed on
    assert "REAL []" in ds.stdout
