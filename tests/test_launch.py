"""The launchers: torchrun exits non-zero when a rank dies, the spawn harness surfaces failing
ranks and never hangs, and plain `python` gives a world of one."""
import time
import types

import pytest
import torch

import primitives as P
from primitives.launch import SpawnError, spawn

from conftest import run_cmd


def test_torchrun_exits_nonzero_when_a_rank_dies():
    t0 = time.monotonic()
    r = run_cmd("torchrun --standalone --nproc_per_node 2 tests/launch_dying_rank.py --timeout 10",
                timeout=150, check=False)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0, r.stdout + r.stderr
    assert "finished an all-reduce without rank 1" not in r.stdout
    assert elapsed < 120, f"torchrun took {elapsed:.0f}s to notice the dead rank"


def test_plain_python_is_a_world_of_one():
    r = run_cmd("python -c \"from primitives.launch import init_from_env; import torch, primitives as P; "
                "c = init_from_env('gloo'); t = torch.arange(3.); P.all_reduce(t); print(c.rank, c.size, c.backend, t.tolist())\"",
                timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "0 1 gloo [0.0, 1.0, 2.0]"


def _fails_on_rank_1(rank, n):
    if rank == 1:
        raise ValueError("boom on purpose")
    P.broadcast(torch.zeros(3), 1)          # rank 0 waits for rank 1, which never sends
    return "unreachable"


def test_spawn_surfaces_the_failing_rank_and_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as ei:
        spawn(_fails_on_rank_1, 2, grace=2.0, comm_timeout=30, timeout=60)
    msg = str(ei.value)
    assert "rank 1 (error" in msg and "ValueError: boom on purpose" in msg
    assert time.monotonic() - t0 < 25, "the first failure must end the run after `grace` seconds"


def _sleeps(rank, n):
    time.sleep(600)


def test_spawn_deadline_kills_ranks_that_never_finish():
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as ei:
        spawn(_sleeps, 2, timeout=3.0)
    assert "never reported" in str(ei.value) and "[0, 1]" in str(ei.value)
    assert time.monotonic() - t0 < 20


def _returns(rank, n, k):
    return {"rank": rank, "n": n, "k": k, "t": torch.full((2,), rank)}


def test_spawn_returns_per_rank_values_in_rank_order():
    out = spawn(_returns, 3, args=(7,))
    assert [o["rank"] for o in out] == [0, 1, 2] and all(o["n"] == 3 and o["k"] == 7 for o in out)
    assert torch.equal(out[2]["t"], torch.full((2,), 2))


def _imported(rank, n):
    import sys
    return {m: m in sys.modules for m in ("torch._dynamo", "deepspeed")}


def test_ranks_fork_warm_but_never_with_deepspeed(monkeypatch):
    """A rank finds torch._dynamo imported (torch.optim's first optimizer would import it: ~2 CPU s
    a rank) and never DeepSpeed, even where this process imported it: a rank may install
    zero_from_scratch's finder, so that its `import deepspeed` is ringzero's engine."""
    import sys
    from primitives import launch
    assert spawn(_imported, 2) == [{"torch._dynamo": True, "deepspeed": False}] * 2
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))     # as if this process imported it
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils", raising=False)
    assert "torch._dynamo" in launch._preload() and "deepspeed" not in launch._preload()
    assert "transformers.modeling_utils" not in launch._preload()   # a parent without HF's models: lean ranks
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", types.ModuleType("transformers.modeling_utils"))
    assert "transformers.modeling_utils" in launch._preload() and "deepspeed" not in launch._preload()


def _env(rank, n, name):
    import os
    return os.environ.get(name), os.environ["RANK"]


def test_ranks_get_the_environment_as_it_is_at_each_spawn(monkeypatch):
    spawn(_returns, 1, args=(0,))       # the forkserver has started by now, with the environment of then
    monkeypatch.setenv("RINGZERO_TEST_LATE", "set after a first spawn")
    assert spawn(_env, 2, args=("RINGZERO_TEST_LATE",)) == [("set after a first spawn", "0"), ("set after a first spawn", "1")]
    monkeypatch.delenv("HOME")          # the forkserver has it: gone from the ranks too
    assert spawn(_env, 1, args=("HOME",)) == [(None, "0")]


def test_exit_leaves_no_gloo_threads_when_a_module_captured_the_group(tmp_path):
    # torch's ShardedGradScaler evaluates `process_group=dist.group.WORLD` when imported: imported
    # after init (transformers does), it would keep the group alive past destroy_process_group,
    # and the group's gloo threads abort the process at exit ("terminate called without an active
    # exception")
    script = tmp_path / "capture.py"
    script.write_text(
        "import os, sys\n"
        "from primitives.launch import init_from_env, shutdown\n"
        "init_from_env('gloo', 60)\n"
        "import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401\n"
        "shutdown()\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
        f"open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w')"
        ".write(repr(sorted(n for n in names if 'gloo' in n)))\n")
    r = run_cmd(f"torchrun --standalone --nproc_per_node 2 {script}", timeout=120)
    # one file per rank: the two ranks' stdout lines may interleave in torchrun's pipe
    assert [(tmp_path / f"rank{k}").read_text() for k in (0, 1)] == ["[]", "[]"], r.stdout + r.stderr
